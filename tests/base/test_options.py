"""Every value a user gives is checked against its range, and a bad one is one line that
names the option and its range (exit 2), never a traceback: the Locust plugin's options
(command line, web UI form, REST endpoints), every `calculet-load` subcommand's numbers,
and every numeric field of a mix and a matrix."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from calculet_drivers.cli import build_parser
from calculet_load.locust.options import OPTIONS, convert
from calculet_load.ranges import Number
from calculet_load.workload.matrix import MatrixError, parse_matrix
from calculet_load.workload.mixes import MixError, parse_mix
from tests.support.locustproc import LOCUSTFILE
from tests.support.ports import free_port
from tests.support.simproc import SimProcess

pytestmark = pytest.mark.timeout(120)

CANDIDATES = ("0", "-3", "99999999", "1e30", "abc", "", "nan", "inf", "1.5")


def _bad(number: Number) -> list[str]:
    """The candidate values `number` refuses (each kind of bad value its range has)."""
    return [v for v in CANDIDATES if number.parse("x", v)[1] is not None]


def _defaults() -> argparse.Namespace:
    return argparse.Namespace(**{o.dest: o.kw.get("default") for o in OPTIONS})


NUMERIC = [o for o in OPTIONS if o.number is not None]


@pytest.mark.parametrize("option", NUMERIC, ids=[o.flag for o in NUMERIC])
def test_every_locust_option_refuses_bad_values_in_one_line(option: Any) -> None:
    bad = _bad(option.number)
    assert {"abc", "", "nan"} <= set(bad) and len(bad) >= 5  # each option has bounds both ways
    for value in bad:
        opts = _defaults()
        setattr(opts, option.dest, value)
        problems = convert(opts)
        assert problems == [f"{option.flag} must be {option.number.describe()}, got {value!r}"]
    opts = _defaults()
    assert convert(opts) == []  # every default is in range


def _subcommand_numbers() -> list[tuple[str, str, Number]]:
    parser, _ = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    out = []
    for name, p in sub.choices.items():
        for action in p._actions:
            if isinstance(action.type, Number):
                out.append((name, action.option_strings[0], action.type))
            else:
                assert action.type not in (int, float), f"{name} {action.option_strings}"
    return out


SUBCOMMAND_NUMBERS = _subcommand_numbers()


@pytest.mark.parametrize(
    ("command", "flag", "number"),
    SUBCOMMAND_NUMBERS,
    ids=[f"{c} {f}" for c, f, _ in SUBCOMMAND_NUMBERS],
)
def test_every_subcommand_number_refuses_bad_values_in_one_line(
    command: str, flag: str, number: Number, capsys: pytest.CaptureFixture[str]
) -> None:
    parser, _ = build_parser()
    for value in _bad(number):
        with pytest.raises(SystemExit) as done:
            parser.parse_args([command, f"{flag}={value}"])
        assert done.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err, err
        assert err.startswith(f"calculet-load {command}: argument {flag}: must be "), err


MIX_FIELDS = {
    "weight": ["0", "-3", "1e30"],
    "prompt_tokens": ["0", "-3", "99999999"],
    "max_tokens": ["0", "-3", "99999999"],
    "temperature": ["-3", "1e30"],
    "samples": ["0", "-3", "99999999"],
}
CELL_FIELDS = {
    "prompt_tokens": ["0", "99999999"],
    "max_tokens": ["0", "99999999"],
    "concurrency": ["0", "-3", "99999999"],
    "rate": ["0", "-3", "1e30"],
    "burstiness": ["0", "1e30"],
    "size": ["0", "99999999"],
    "rounds": ["0", "99999999"],
    "repetitions": ["0", "99999999"],
    "max_in_flight": ["0", "99999999"],
}


@pytest.mark.parametrize("field", sorted(MIX_FIELDS))
def test_every_mix_field_is_checked_against_its_range(field: str) -> None:
    for value in [*MIX_FIELDS[field], "abc"]:
        entry = {"name": "a", "weight": 1, "prompt_tokens": 8, "max_tokens": 4, field: value}
        with pytest.raises(MixError) as exc:
            parse_mix({"name": "m", "entries": [entry]}, "m.yaml")
        assert str(exc.value).startswith(f"m.yaml: entries.0.{field}: "), str(exc.value)


@pytest.mark.parametrize("field", sorted(CELL_FIELDS))
def test_every_matrix_field_is_checked_against_its_range(field: str) -> None:
    for value in [*CELL_FIELDS[field], "abc"]:
        cell = {"name": "c", "kind": "closed", field: value}
        with pytest.raises(MatrixError) as exc:
            parse_matrix({"name": "m", "cells": [cell]}, "m.yaml")
        assert str(exc.value).startswith(f"m.yaml: cells.0.{field}: "), str(exc.value)


@pytest.mark.parametrize(
    "args",
    [
        ["--max-tokens", "0"],
        ["--max-tokens", "-3"],
        ["--prompt-tokens", "0"],
        ["--prompt-tokens", "99999999"],
        ["--rate", "abc"],
        ["--max-in-flight", ""],
    ],
    ids=lambda a: " ".join(a),
)
def test_locust_exits_2_with_one_line(args: list[str], tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "locust", "-f", LOCUSTFILE, "--headless", "-H",
         "http://127.0.0.1:9", "-t", "5s", "--run-dir", str(tmp_path / "run"), *args],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    out = done.stdout + done.stderr
    ours = [line for line in out.splitlines() if line.startswith("calculet-load:")]
    assert done.returncode == 2, out
    assert len(ours) == 1 and args[0] in ours[0] and "must be" in ours[0], out
    assert "Traceback" not in out and not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def web_ui(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Locust web UI (not started) against a real simulator: its base URL."""
    tmp = tmp_path_factory.mktemp("form")
    sim = SimProcess(tmp)
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "locust", "-f", LOCUSTFILE, "-H", sim.url, "--web-host",
         "127.0.0.1", "--web-port", str(port), "--run-dir", str(tmp / "run")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(base + "/", timeout=2).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "the web UI did not come up"
                time.sleep(0.3)
        yield base
    finally:
        proc.terminate()
        proc.wait(20)
        sim.stop()


def _post(url: str, data: bytes, ctype: str) -> tuple[int, Any]:
    req = urllib.request.Request(url, data=data, headers={"Content-Type": ctype})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


FORM = [("max_tokens", "0"), ("rate", "abc"), ("prompt_tokens", "99999999"), ("seed", "")]


@pytest.mark.parametrize(("field", "value"), FORM)
def test_the_start_form_shows_the_message(web_ui: str, field: str, value: str) -> None:
    form = urllib.parse.urlencode({"user_count": 1, "spawn_rate": 1, field: value}).encode()
    status, body = _post(web_ui + "/swarm", form, "application/x-www-form-urlencoded")
    flag = "--" + field.replace("_", "-")
    assert status == 200 and body["success"] is False, body
    assert body["message"].startswith(f"calculet-load: {flag} must be "), body


@pytest.mark.parametrize(("path", "body", "says"), [
    ("/calculet/rate", {"rate": -1}, "rate must be a number >= 0"),
    ("/calculet/rate", {"rate": "fast"}, "rate must be a number >= 0"),
    ("/calculet/rate", {}, "rate must be a number >= 0"),
    ("/calculet/burst", {"size": 0}, "size must be a whole number >= 1"),
    ("/calculet/burst", {"size": "1e9"}, "size must be a whole number >= 1"),
])  # fmt: skip
def test_the_rest_endpoints_answer_400_with_the_message(
    web_ui: str, path: str, body: dict[str, Any], says: str
) -> None:
    status, answer = _post(web_ui + path, json.dumps(body).encode(), "application/json")
    assert status == 400 and answer["error"].startswith(says), answer
