#!/bin/sh
# Run one stability stage of spec §13 and keep its report. The one command behind every
# scheduled run: the systemd unit calculet-soak@.service, the cron line
# calculet-soak.cron and the Kubernetes CronJob calculet-soak-cronjob.yaml all run
#   /opt/calculet-load/deploy/soak/run-soak.sh STAGE
# Each run gets its own folder RUNS/soak-STAGE-<UTC time> (never deleted: retention is
# the operator's), `soak-STAGE-latest` points at the last finished one, and
# RUNS/soak-history.log gets one line per soak process with its exit code (docs/soak.md).
#
# Resuming: while a run is unfinished, `soak-STAGE-current` points at it. If the soak
# process was killed (SIGKILL, OOM, host reboot) or stopped (SIGTERM), the next call
# continues that run (`calculet-load soak --resume`) to its planned end instead of
# starting a new one; the gap is recorded in its soak.json. A run whose planned end has
# passed is only finalised (judged, with the gap to its end), then a new run starts.
#   run-soak.sh --resume-only STAGE   continue an unfinished run if there is one, never
#                                     start a new run (at boot, or every few minutes)
# A lock (flock, RUNS/.soak-STAGE.lock) keeps two calls for one stage from running at
# once: the second exits 0 at once.
#
# Environment (all optional):
#   CALCULET_HOME       the calculet-load checkout (default /opt/calculet-load)
#   CALCULET_BIN        the calculet-load command (default $CALCULET_HOME/.venv/bin/calculet-load)
#   CALCULET_MANIFEST   the run manifest (default /etc/calculet-load/manifest.yaml)
#   CALCULET_RUNS       where run folders are kept (default /var/lib/calculet-load/runs)
#   CALCULET_SOAK_ARGS  extra arguments of `calculet-load soak` (e.g. --golden FILE); a
#                       resumed run is given the same ones
#   CALCULET_ADMIN_TOKEN  the target's admin token (resource state, time scale)
set -eu
resume_only=0
if [ "${1:-}" = "--resume-only" ]; then
    resume_only=1
    shift
fi
stage="${1:?usage: run-soak.sh [--resume-only] STAGE (smoke, dev, candidate, release, endurance)}"
home="${CALCULET_HOME:-/opt/calculet-load}"
bin="${CALCULET_BIN:-$home/.venv/bin/calculet-load}"
manifest="${CALCULET_MANIFEST:-/etc/calculet-load/manifest.yaml}"
runs="${CALCULET_RUNS:-/var/lib/calculet-load/runs}"
current="$runs/soak-$stage-current"
mkdir -p "$runs"
cd "$home"
if command -v flock >/dev/null 2>&1; then
    exec 9>"$runs/.soak-$stage.lock"
    if ! flock -n 9; then
        echo "run-soak.sh: a soak of stage $stage is running already" >&2
        exit 0
    fi
fi

# soak RUN_DIR [--resume RUN_DIR]: one soak process; its exit code in $code
soak() {
    dir="$1"
    shift
    set +e
    # shellcheck disable=SC2086  # CALCULET_SOAK_ARGS is a list of arguments: split it
    "$bin" soak --stage "$stage" --manifest "$manifest" --run-dir "$dir" "$@" \
        ${CALCULET_SOAK_ARGS:-}
    code=$?
    set -e
    how="new"
    if [ $# -gt 0 ]; then
        how="resumed"
    fi
    if [ -f "$dir/soak.json" ]; then
        rm -f "$current"
        ln -sfn "$dir" "$runs/soak-$stage-latest"
        state="finished"
    else
        state="unfinished"
    fi
    echo "$(date -u +%Y%m%dT%H%M%SZ) stage=$stage exit=$code run_dir=$dir $how $state" \
        >> "$runs/soak-history.log"
}

code=0
if [ -L "$current" ] && [ -f "$current/soak/state.json" ] && [ ! -f "$current/soak.json" ]; then
    run_dir="$(readlink "$current")"
    end_ns="$(sed -n 's/.*"planned_end_wall_ns": *\([0-9][0-9]*\).*/\1/p' \
        "$run_dir/soak/state.json" | head -n 1)"
    expired=0
    if [ -n "$end_ns" ] && [ "${end_ns%?????????}" -le "$(date +%s)" ]; then
        expired=1
    fi
    soak "$run_dir" --resume "$run_dir"
    if [ "$code" -eq 2 ] && [ ! -f "$run_dir/soak.json" ]; then
        # it cannot be resumed (a changed manifest or options): keep it, stop trying
        echo "run-soak.sh: $run_dir cannot be resumed (exit 2); left unfinished" >&2
        rm -f "$current"
        expired=1
    fi
    if [ "$expired" -eq 0 ] || [ "$resume_only" -eq 1 ] || [ -L "$current" ]; then
        exit "$code"
    fi
elif [ "$resume_only" -eq 1 ]; then
    exit 0  # nothing to resume
fi
run_dir="$runs/soak-$stage-$(date -u +%Y%m%dT%H%M%SZ)"
ln -sfn "$run_dir" "$current"
soak "$run_dir"
exit "$code"
