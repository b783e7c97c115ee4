#!/bin/sh
# Run one stability stage of spec §13 and keep its report. The one command behind every
# scheduled run: the systemd unit calculet-soak@.service, the cron line
# calculet-soak.cron and the Kubernetes CronJob calculet-soak-cronjob.yaml all run
#   /opt/calculet-load/deploy/soak/run-soak.sh STAGE
# Each run gets its own folder RUNS/soak-STAGE-<UTC time> (never reused, never deleted:
# retention is the operator's), `soak-STAGE-latest` points at the last one, and
# RUNS/soak-history.log gets one line per run with its exit code (docs/soak.md).
#
# Environment (all optional):
#   CALCULET_HOME       the calculet-load checkout (default /opt/calculet-load)
#   CALCULET_BIN        the calculet-load command (default $CALCULET_HOME/.venv/bin/calculet-load)
#   CALCULET_MANIFEST   the run manifest (default /etc/calculet-load/manifest.yaml)
#   CALCULET_RUNS       where run folders are kept (default /var/lib/calculet-load/runs)
#   CALCULET_SOAK_ARGS  extra arguments of `calculet-load soak` (e.g. --golden FILE)
#   CALCULET_ADMIN_TOKEN  the target's admin token (resource state, time scale)
set -eu
stage="${1:?usage: run-soak.sh STAGE (smoke, dev, candidate, release, endurance)}"
home="${CALCULET_HOME:-/opt/calculet-load}"
bin="${CALCULET_BIN:-$home/.venv/bin/calculet-load}"
manifest="${CALCULET_MANIFEST:-/etc/calculet-load/manifest.yaml}"
runs="${CALCULET_RUNS:-/var/lib/calculet-load/runs}"
stamp="$(date -u +%Y%m%dT%H%M%SZ)"
run_dir="$runs/soak-$stage-$stamp"
mkdir -p "$runs"
cd "$home"
set +e
# shellcheck disable=SC2086  # CALCULET_SOAK_ARGS is a list of arguments: split it
"$bin" soak --stage "$stage" --manifest "$manifest" --run-dir "$run_dir" ${CALCULET_SOAK_ARGS:-}
code=$?
set -e
ln -sfn "$run_dir" "$runs/soak-$stage-latest"
echo "$stamp stage=$stage exit=$code run_dir=$run_dir" >> "$runs/soak-history.log"
exit "$code"
