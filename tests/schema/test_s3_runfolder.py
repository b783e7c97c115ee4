"""A run folder in an object store: `--run-dir s3://bucket/prefix` end to end.

A real S3-compatible server (moto's server mode) runs on loopback; the endpoint and the
credentials reach pyarrow through the standard AWS environment variables only, as they
would on client hosts. A Locust master with two workers writes the run there (every
worker's parts, the master's index, the server samples), then `calculet-load analyze`
reads the URI back and must reach the same verdict and summary as from a local copy.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import pytest

from calculet_load.schema.fs import resolve_fs
from calculet_load.schema.liveseries import read_live_series
from tests.support.locustproc import LocustRun
from tests.support.ports import free_port
from tests.support.simproc import SimProcess

pytestmark = pytest.mark.timeout(180)

BUCKET = "calculet-runs"
BIN = Path(sys.executable).parent


@pytest.fixture
def s3(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A loopback S3 server with one bucket; the AWS_* variables point at it."""
    port = free_port()
    log = open(tmp_path / "moto.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    pytest.fail(f"moto server did not start: {(tmp_path / 'moto.log').read_text()}")
                time.sleep(0.1)
        endpoint = f"http://127.0.0.1:{port}"
        env = {
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
        }
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        pafs.S3FileSystem(
            endpoint_override=endpoint,
            scheme="http",
            access_key="testing",
            secret_key="testing",
            region="us-east-1",
            allow_bucket_creation=True,
        ).create_dir(BUCKET)
        yield endpoint
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


def _read(fs: pafs.FileSystem, path: str) -> bytes:
    with fs.open_input_stream(path) as f:
        return bytes(f.read())


def _analyze(target: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "calculet-load"), "analyze", target, "--quiet"],
        capture_output=True,
        text=True,
        timeout=120,
    )


def _comparable(doc: Any) -> Any:
    """The verdict document without the folder's own address (`uri`, at any depth)."""
    if isinstance(doc, dict):
        return {k: _comparable(v) for k, v in doc.items() if k != "uri"}
    if isinstance(doc, list):
        return [_comparable(v) for v in doc]
    return doc


def test_two_workers_write_to_s3_and_analyze_reads_it_back(
    s3: str, start_sim: Any, tmp_path: Path
) -> None:
    sim: SimProcess = start_sim("--profile", "b16", "--time-scale", "0.01")
    uri = f"s3://{BUCKET}/runs/r-s3"
    run = LocustRun(
        tmp_path,
        sim.url,
        [
            *("--run-dir", uri, "--run-id", "r-s3", "--seed", "3"),
            # a worker's first S3 calls (client set-up) take a moment: start after them
            *("--arrival", "poisson", "--rate", "12", "--start-delay", "3"),
            *("--scrape-interval", "1", "-u", "2", "-r", "2"),
            *("--exit-code-on-error", "0"),  # a refused request is data here, not a failure
        ],
        workers=2,
        run_time_s=10.0,
    )
    run.start()
    assert run.wait() == 0, run.log_text()
    assert not run.run_dir.exists()  # nothing went to the local default

    fs, root = resolve_fs(uri)
    assert isinstance(fs, pafs.S3FileSystem)
    index = json.loads(_read(fs, f"{root}/client/index.json"))
    assert index["status"] == "complete" and index["plan"]["run_dir"] == uri, index
    workers = {w["worker"]: w for w in index["workers"]}
    assert set(workers) == {"w00", "w01"}
    for name, w in workers.items():
        assert w["status"] == "reported" and w["requests"] > 0, w
        listed = fs.get_file_info(pafs.FileSelector(f"{root}/client/{name}"))
        on_s3 = sorted(i.base_name for i in listed if i.base_name.endswith(".parquet"))
        assert on_s3 == sorted(w["parts"]), (on_s3, w["parts"])
    # the master's samples of the simulator: object stores cannot append, so each file
    # was rewritten whole; every row is there and parses
    for rel, key in (("server/metrics.jsonl", "samples"), ("server/process.jsonl", "rss_bytes")):
        rows = [json.loads(x) for x in _read(fs, f"{root}/{rel}").splitlines()]
        assert len(rows) >= 8 and all(r[key] for r in rows), rel

    # the master's live series (two workers merged): also rewritten whole, every point
    points = read_live_series(uri, index["live_series"])
    assert len(points) == index["live_series"]["points"] >= 8, index["live_series"]
    assert points[-1].final and points[-1].requests > 0 and points[-1].rate == 12.0
    assert any(p.ttft_p50_ms is not None and p.in_flight is not None for p in points)

    # the same folder, copied to a local path, is judged the same way
    local = tmp_path / "copy"
    pafs.copy_files(root, str(local), source_filesystem=fs)
    from_s3, from_local = _analyze(uri), _analyze(str(local))
    assert from_s3.returncode == from_local.returncode, (from_s3.stderr, from_local.stderr)
    assert from_s3.returncode != 2, from_s3.stderr  # 2: the folder could not be read
    assert from_s3.stdout.strip() == from_local.stdout.strip()
    v_s3 = json.loads(_read(fs, f"{root}/verdict.json"))
    v_local = json.loads((local / "verdict.json").read_text())
    assert v_s3["run"]["uri"] == uri
    assert _comparable(v_s3) == _comparable(v_local)
    assert _read(fs, f"{root}/summary.csv") == (local / "summary.csv").read_bytes()
    n = sum(w["requests"] + w["dropped"] for w in workers.values())
    assert n > 50
