"""Scheduled soak runs (deploy/soak/): the systemd units and timer pass `systemd-analyze
verify`, the cron lines parse, the CronJob has the shape of a Kubernetes batch/v1
CronJob, all three run one command, and that command, run here, runs a soak stage and
keeps its report; a soak killed mid-stage is resumed by the same script (`--resume-only`,
what the boot unit, the cron line and a retried pod run) in the same folder."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from tests.conftest import REPO
from tests.drivers.soak.test_soak import bounded_rules
from tests.support.simproc import ADMIN_TOKEN, SimProcess

StartSim = Callable[..., SimProcess]
DEPLOY = REPO / "deploy" / "soak"
PREFIX = "/opt/calculet-load"
# The command every template runs (for the dev stage), below the install prefix.
COMMAND = [f"{PREFIX}/deploy/soak/run-soak.sh", "dev"]
# ... and the one that only resumes an unfinished run (at boot; every 10 min by cron)
RESUME = [f"{PREFIX}/deploy/soak/run-soak.sh", "--resume-only", "dev"]
UNITS = ("calculet-soak@.service", "calculet-soak@.timer", "calculet-soak-resume@.service")


# --------------------------------------------------------------------------- systemd
def _render_units(tmp: Path, stage: str = "dev") -> list[Path]:
    """The template unit and timer as instances, with the script at this checkout's path
    (verify checks that ExecStart's program exists and is executable)."""
    out = []
    for name in UNITS:
        text = (DEPLOY / name).read_text().replace(f"{PREFIX}/deploy", str(REPO / "deploy"))
        path = tmp / name.replace("@.", f"@{stage}.")
        path.write_text(text)
        out.append(path)
    return out


def _verify(paths: list[Path]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["systemd-analyze", "verify", *map(str, paths)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze here")
def test_systemd_units_verify(tmp_path: Path) -> None:
    units = _render_units(tmp_path)
    proc = _verify(units)
    assert proc.returncode == 0, proc.stderr
    # verify reports problems of a unit file as warnings naming it: there must be none
    mine = [line for line in proc.stderr.splitlines() if "calculet-soak@" in line]
    assert mine == [], proc.stderr
    # ... and it does see them: the same unit with a typo is reported
    bad = tmp_path / "bad"
    bad.mkdir()
    broken = _render_units(bad)
    broken[0].write_text(broken[0].read_text().replace("Type=oneshot", "Type=oneshott"))
    assert "Failed to parse service type" in _verify(broken).stderr


def _systemd_exec(stage: str, unit: str = "calculet-soak@.service") -> list[str]:
    text = (DEPLOY / unit).read_text()
    line = next(x for x in text.splitlines() if x.startswith("ExecStart="))
    return shlex.split(line.removeprefix("ExecStart=").replace("%i", stage))


def _unit_settings(unit: str) -> dict[str, str]:
    lines = (DEPLOY / unit).read_text().splitlines()
    return dict(x.split("=", 1) for x in lines if "=" in x and not x.startswith("#"))


def test_services_restart_and_resume_only_a_soak_that_died() -> None:
    """Killed (OOM, SIGKILL) → restarted, and run-soak.sh resumes the run; a verdict
    (1), a bad config (2), an invalid measurement (3) or a deliberate stop is not."""
    for unit in ("calculet-soak@.service", "calculet-soak-resume@.service"):
        cfg = _unit_settings(unit)
        assert cfg["Restart"] == "on-failure", unit
        prevent = set(cfg["RestartPreventExitStatus"].split())
        assert {"1", "2", "3", "143", "SIGTERM"} <= prevent and "137" not in prevent, unit
    assert _systemd_exec("dev", "calculet-soak-resume@.service") == RESUME
    assert "WantedBy=multi-user.target" in (DEPLOY / "calculet-soak-resume@.service").read_text()


def test_timer_starts_the_service_of_its_stage() -> None:
    timer = (DEPLOY / "calculet-soak@.timer").read_text()
    assert "Unit=calculet-soak@%i.service" in timer
    assert re.search(r"^OnCalendar=.+$", timer, re.M) and "Persistent=true" in timer


# ------------------------------------------------------------------------------ cron
_MONTHS = ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec")
_DAYS = ("sun", "mon", "tue", "wed", "thu", "fri", "sat")
_CRON_FIELDS = [  # (name, low, high, names)
    ("minute", 0, 59, {}),
    ("hour", 0, 23, {}),
    ("day of month", 1, 31, {}),
    ("month", 1, 12, {m: i + 1 for i, m in enumerate(_MONTHS)}),
    ("day of week", 0, 7, {d: i for i, d in enumerate(_DAYS)}),
]


def parse_cron_field(text: str, low: int, high: int, names: dict[str, int]) -> set[int]:
    """The values of one cron time field (`*`, lists, ranges, steps, names)."""
    out: set[int] = set()
    for item in text.lower().split(","):
        base, _, step_text = item.partition("/")
        step = int(step_text) if step_text else 1
        if step < 1:
            raise ValueError(f"{item}: step must be >= 1")
        if base == "*":
            lo, hi = low, high
        else:
            a, _, b = base.partition("-")
            lo = names[a] if a in names else int(a)
            hi = (names[b] if b in names else int(b)) if b else (high if step_text else lo)
        if not low <= lo <= hi <= high:
            raise ValueError(f"{item}: outside {low}..{high}")
        out.update(range(lo, hi + 1, step))
    return out


def cron_jobs(path: Path) -> list[tuple[list[set[int]], str, list[str]]]:
    """(time field values, user, command) of each job line of an /etc/cron.d file."""
    jobs = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#") or re.match(r"^[A-Z_]+=", line):
            continue
        parts = line.split(None, 6)
        if len(parts) < 7:
            raise ValueError(f"{line!r}: want 5 time fields, a user and a command")
        fields = [parse_cron_field(parts[i], lo, hi, n) for i, (_, lo, hi, n) in
                  enumerate(_CRON_FIELDS)]  # fmt: skip
        jobs.append((fields, parts[5], shlex.split(parts[6])))
    return jobs


def test_cron_line_parses() -> None:
    jobs = cron_jobs(DEPLOY / "calculet-soak.cron")
    assert len(jobs) == 2
    fields, user, command = jobs[0]
    assert fields[0] == {0} and fields[1] == {2} and fields[4] == {1}  # Mondays 02:00
    assert user == "calculet"
    assert command == COMMAND
    fields, user, command = jobs[1]  # the resume check, every 10 minutes
    assert fields[0] == set(range(0, 60, 10)) and fields[1] == set(range(24))
    assert user == "calculet" and command == RESUME
    for bad in ("60 2 * * 1", "0 24 * * 1", "0 2 0 * *", "0 2 * 13 *", "0 2 * * 8"):
        with pytest.raises(ValueError):
            for text, (_, lo, hi, names) in zip(bad.split(), _CRON_FIELDS, strict=True):
                parse_cron_field(text, lo, hi, names)
    assert parse_cron_field("*/15", 0, 59, {}) == {0, 15, 30, 45}
    assert parse_cron_field("mon-fri", 0, 7, _CRON_FIELDS[4][3]) == {1, 2, 3, 4, 5}


# ------------------------------------------------------------------------ Kubernetes
# The parts of the Kubernetes batch/v1 CronJob schema (API reference, v1.30) the
# template uses, with the API's required fields and enums; no cluster is needed.
_CONTAINER = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
        "image": {"type": "string", "minLength": 1},
        "command": {"type": "array", "items": {"type": "string"}},
        "args": {"type": "array", "items": {"type": "string"}},
        "env": {"type": "array", "items": {
            "type": "object", "required": ["name"],
            "properties": {"name": {"type": "string"}, "value": {"type": "string"},
                           "valueFrom": {"type": "object"}}, "additionalProperties": False}},
        "resources": {"type": "object", "properties": {
            "requests": {"type": "object"}, "limits": {"type": "object"}},
            "additionalProperties": False},
        "volumeMounts": {"type": "array", "items": {
            "type": "object", "required": ["name", "mountPath"]}},
    },
}  # fmt: skip
_POD_SPEC = {
    "type": "object",
    "required": ["containers"],
    "properties": {
        "restartPolicy": {"enum": ["OnFailure", "Never"]},  # a Job's pods may not be Always
        "containers": {"type": "array", "minItems": 1, "items": _CONTAINER},
        "volumes": {"type": "array", "items": {"type": "object", "required": ["name"]}},
        "securityContext": {"type": "object"},
    },
}
_POD_FAILURE_POLICY = {  # batch/v1 Job spec.podFailurePolicy (GA in v1.31)
    "type": "object",
    "required": ["rules"],
    "additionalProperties": False,
    "properties": {"rules": {"type": "array", "maxItems": 20, "items": {
        "type": "object",
        "required": ["action"],
        "additionalProperties": False,
        "properties": {
            "action": {"enum": ["FailJob", "FailIndex", "Ignore", "Count"]},
            "onExitCodes": {
                "type": "object", "required": ["operator", "values"],
                "additionalProperties": False,
                "properties": {"containerName": {"type": "string"},
                               "operator": {"enum": ["In", "NotIn"]},
                               "values": {"type": "array", "minItems": 1, "maxItems": 255,
                                          "uniqueItems": True, "items": {"type": "integer"}}}},
            "onPodConditions": {"type": "array", "maxItems": 20, "items": {
                "type": "object", "required": ["type"], "additionalProperties": False,
                "properties": {"type": {"type": "string"},
                               "status": {"enum": ["True", "False", "Unknown"]}}}},
        },
        "oneOf": [{"required": ["onExitCodes"]}, {"required": ["onPodConditions"]}],
    }}},
}  # fmt: skip
CRONJOB_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "batch/v1"},
        "kind": {"const": "CronJob"},
        "metadata": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": {"type": "string", "maxLength": 52,
                         "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
                "labels": {"type": "object", "additionalProperties": {"type": "string"}},
            },
        },
        "spec": {
            "type": "object",
            "required": ["schedule", "jobTemplate"],
            "additionalProperties": False,
            "properties": {
                "schedule": {"type": "string", "minLength": 9},
                "timeZone": {"type": "string"},
                "concurrencyPolicy": {"enum": ["Allow", "Forbid", "Replace"]},
                "startingDeadlineSeconds": {"type": "integer", "minimum": 0},
                "successfulJobsHistoryLimit": {"type": "integer", "minimum": 0},
                "failedJobsHistoryLimit": {"type": "integer", "minimum": 0},
                "suspend": {"type": "boolean"},
                "jobTemplate": {
                    "type": "object",
                    "required": ["spec"],
                    "properties": {
                        "metadata": {"type": "object"},
                        "spec": {
                            "type": "object",
                            "required": ["template"],
                            "properties": {
                                "backoffLimit": {"type": "integer", "minimum": 0},
                                "podFailurePolicy": _POD_FAILURE_POLICY,
                                "activeDeadlineSeconds": {"type": "integer", "minimum": 1},
                                "template": {
                                    "type": "object",
                                    "required": ["spec"],
                                    "properties": {"metadata": {"type": "object"},
                                                   "spec": _POD_SPEC},
                                },
                            },
                        },
                    },
                },
            },
        },
    },
}  # fmt: skip


def _cronjob() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((DEPLOY / "calculet-soak-cronjob.yaml").read_text())
    return doc


def test_cronjob_is_a_valid_batch_v1_cronjob() -> None:
    doc = _cronjob()
    jsonschema.validate(doc, CRONJOB_SCHEMA)
    schedule = doc["spec"]["schedule"].split()
    assert len(schedule) == 5
    for text, (_, lo, hi, names) in zip(schedule, _CRON_FIELDS, strict=True):
        parse_cron_field(text, lo, hi, names)
    assert doc["spec"]["concurrencyPolicy"] == "Forbid"
    # a killed pod (OOM: 137) is retried, and its retry resumes the run; a verdict is not
    job = doc["spec"]["jobTemplate"]["spec"]
    assert job["template"]["spec"]["restartPolicy"] == "Never"  # podFailurePolicy needs it
    fail = job["podFailurePolicy"]["rules"][0]
    assert fail["action"] == "FailJob" and fail["onExitCodes"]["values"] == [1, 2, 3]
    assert fail["onExitCodes"]["containerName"] == job["template"]["spec"]["containers"][0]["name"]
    assert job["backoffLimit"] >= 1
    # the schema does catch a wrong document
    bad = json.loads(json.dumps(doc))
    bad["spec"]["jobTemplate"]["spec"]["template"]["spec"]["restartPolicy"] = "Always"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, CRONJOB_SCHEMA)


def _cronjob_command() -> list[str]:
    pod = _cronjob()["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    c = pod["containers"][0]
    return [*c.get("command", []), *c.get("args", [])]


# ------------------------------------------------------------------ one command
def test_every_template_runs_the_same_command() -> None:
    cron = cron_jobs(DEPLOY / "calculet-soak.cron")[0][2]
    assert _systemd_exec("dev") == cron == _cronjob_command() == COMMAND


@pytest.mark.serial  # the soak's self-watch judges the client's CPU: a busy machine is exit 3
def test_the_scheduled_command_runs_a_stage_and_keeps_reports(
    start_sim: StartSim, tmp_path: Path
) -> None:
    """COMMAND, with this checkout as the install prefix, against a simulator."""
    sim = start_sim("--time-scale", "0.02", faults=True)
    runs = tmp_path / "runs"
    rules = bounded_rules(tmp_path)
    env = {
        **os.environ,
        "CALCULET_HOME": str(REPO),
        "CALCULET_MANIFEST": str(REPO / "configs" / "manifest.sim.yaml"),
        "CALCULET_RUNS": str(runs),
        "CALCULET_ADMIN_TOKEN": ADMIN_TOKEN,
        "CALCULET_SOAK_ARGS": f"--url {sim.url} --duration-scale 0.05 --target-rate 0.25 "
        f"--rules {rules} --quiet",
    }
    command = [COMMAND[0].replace(PREFIX, str(REPO)), *COMMAND[1:]]
    for _ in range(2):
        proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    kept = sorted(p for p in runs.glob("soak-dev-2*") if p.is_dir())
    assert len(kept) == 2  # each run keeps its own report
    for run in kept:
        doc = json.loads((run / "soak.json").read_text())
        assert doc["stage"] == "dev" and doc["verdict"] == "PASS"
    assert (runs / "soak-dev-latest").resolve() == kept[-1].resolve()
    history = (runs / "soak-history.log").read_text().splitlines()
    assert len(history) == 2 and all("stage=dev exit=0" in h for h in history)
    assert not (runs / "soak-dev-current").exists()  # nothing unfinished
    proc = subprocess.run([RESUME[0].replace(PREFIX, str(REPO)), *RESUME[1:]], env=env,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0 and len(list(runs.glob("soak-dev-2*"))) == 2  # nothing done


@pytest.mark.slow  # test_soak checks the resume itself; this, the script's path to it
def test_the_scheduled_command_resumes_a_killed_soak(start_sim: StartSim, tmp_path: Path) -> None:
    """The soak process of a scheduled run is killed mid-stage (as by the OOM killer):
    the script keeps the run unfinished; `run-soak.sh --resume-only dev` (what the boot
    unit, the cron line and the CronJob's retried pod run) continues it in the same
    folder to its planned end, with the gap recorded."""
    sim = start_sim("--time-scale", "0.02", faults=True)
    runs = tmp_path / "runs"
    env = {
        **os.environ,
        "CALCULET_HOME": str(REPO),
        "CALCULET_MANIFEST": str(REPO / "configs" / "manifest.sim.yaml"),
        "CALCULET_RUNS": str(runs),
        "CALCULET_ADMIN_TOKEN": ADMIN_TOKEN,
        "CALCULET_SOAK_ARGS": f"--url {sim.url} --duration-scale 0.2 --target-rate 0.25 "
        f"--rules {bounded_rules(tmp_path)} --quiet",
    }
    script = COMMAND[0].replace(PREFIX, str(REPO))
    first = subprocess.Popen([script, *COMMAND[1:]], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT)  # fmt: skip
    current = runs / "soak-dev-current"
    deadline = time.monotonic() + 60
    state: dict[str, Any] = {}
    while time.monotonic() < deadline and state.get("status") != "running":
        time.sleep(0.1)
        path = current / "soak" / "state.json"
        state = json.loads(path.read_text()) if path.exists() else {}
    assert state.get("status") == "running", first.communicate()[0][-2000:]
    time.sleep(4)
    os.kill(state["attempts"][0]["pid"], signal.SIGKILL)  # the soak, not the script
    out = first.communicate(timeout=60)[0].decode()
    assert first.returncode == 128 + signal.SIGKILL, out[-2000:]
    run_dir = current.resolve()
    assert not (run_dir / "soak.json").exists()
    proc = subprocess.run([RESUME[0].replace(PREFIX, str(REPO)), *RESUME[1:]], env=env,
                          capture_output=True, text=True, timeout=240)  # fmt: skip
    assert proc.returncode == 3, proc.stdout[-2000:] + proc.stderr[-2000:]  # INCOMPLETE
    doc = json.loads((run_dir / "soak.json").read_text())
    assert doc["verdict"] == "INCOMPLETE" and len(doc["gaps"]) == 1
    assert [a["worker"] for a in doc["attempts"]] == ["w00", "w00-r1"]
    assert sorted(p.name for p in runs.glob("soak-dev-2*")) == [run_dir.name]  # same folder
    assert not current.exists() and (runs / "soak-dev-latest").resolve() == run_dir
    history = (runs / "soak-history.log").read_text().splitlines()
    assert len(history) == 2
    assert "exit=137" in history[0] and history[0].endswith("new unfinished")
    assert "exit=3" in history[1] and history[1].endswith("resumed finished")


pytestmark = pytest.mark.timeout(600)
