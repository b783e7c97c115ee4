"""Scheduled soak runs (deploy/soak/): the systemd unit and timer pass `systemd-analyze
verify`, the cron line parses, the CronJob has the shape of a Kubernetes batch/v1
CronJob, all three run one command, and that command, run here, runs a soak stage and
keeps its report."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from tests.conftest import REPO
from tests.simproc import ADMIN_TOKEN, SimProcess

StartSim = Callable[..., SimProcess]
DEPLOY = REPO / "deploy" / "soak"
PREFIX = "/opt/calculet-load"
# The command every template runs (for the dev stage), below the install prefix.
COMMAND = [f"{PREFIX}/deploy/soak/run-soak.sh", "dev"]


# --------------------------------------------------------------------------- systemd
def _render_units(tmp: Path, stage: str = "dev") -> list[Path]:
    """The template unit and timer as instances, with the script at this checkout's path
    (verify checks that ExecStart's program exists and is executable)."""
    out = []
    for name in ("calculet-soak@.service", "calculet-soak@.timer"):
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


def _systemd_exec(stage: str) -> list[str]:
    text = (DEPLOY / "calculet-soak@.service").read_text()
    line = next(x for x in text.splitlines() if x.startswith("ExecStart="))
    return shlex.split(line.removeprefix("ExecStart=").replace("%i", stage))


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
    assert len(jobs) == 1
    fields, user, command = jobs[0]
    assert fields[0] == {0} and fields[1] == {2} and fields[4] == {1}  # Mondays 02:00
    assert user == "calculet"
    assert command == COMMAND
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


def test_the_scheduled_command_runs_a_stage_and_keeps_reports(
    start_sim: StartSim, tmp_path: Path
) -> None:
    """COMMAND, with this checkout as the install prefix, against a simulator."""
    sim = start_sim("--time-scale", "0.02", faults=True)
    runs = tmp_path / "runs"
    rules = REPO / "tests" / "load" / "data" / "soak-rules.yaml"
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


pytestmark = pytest.mark.timeout(600)
