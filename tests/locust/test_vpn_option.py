"""Spec §5: a manifest with a VPN in the path needs RTT and jitter measured (Locust side)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.support.locustproc import LOCUSTFILE, REPO

pytestmark = pytest.mark.timeout(120)


def _manifest(tmp_path: Path, vpn: bool) -> Path:
    doc = yaml.safe_load((REPO / "configs" / "manifest.sim.yaml").read_text())
    doc["environment"]["vpn_in_path"] = vpn
    path = tmp_path / f"manifest-{vpn}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _locust(*args: str) -> subprocess.CompletedProcess[str]:
    # nothing listens on port 9 of loopback: the run must stop before it sends anything
    cmd = [sys.executable, "-m", "locust", "-f", LOCUSTFILE, "--headless",
           "-H", "http://127.0.0.1:9", "-u", "1", "-r", "1", "-t", "1s", *args]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=REPO)


def test_vpn_in_path_without_rtt_samples_is_exit_2_naming_the_field(tmp_path: Path) -> None:
    p = _locust("--manifest", str(_manifest(tmp_path, True)), "--rtt-samples", "0",
                "--run-dir", str(tmp_path / "run"))  # fmt: skip
    assert p.returncode == 2, p.stderr[-2000:]
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("calculet-load:")]
    assert len(lines) == 1 and "environment.vpn_in_path" in lines[0], p.stderr[-2000:]
    assert "Traceback" not in p.stderr
    assert not (tmp_path / "run").exists()  # refused before anything ran


def test_a_bad_rtt_sample_count_is_refused_too(tmp_path: Path) -> None:
    p = _locust("--rtt-samples", "5000", "--run-dir", str(tmp_path / "run"))
    assert p.returncode == 2
    assert "--rtt-samples must be a whole number >= 0 and <= 1000" in p.stderr
