"""benchmarks/peers.py reads the peers' own outputs (vLLM 0.7.3's
benchmark_serving.py and inference-perf 0.7.0, run by `client_speed.py --peers`): the
files here are trimmed copies of what each wrote against benchmarks/exact_server.py
(TTFT 50 ms, a token every 10 ms), with one failed request added to each."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DATA = Path(__file__).resolve().parents[1] / "data" / "peers"
sys.path.insert(0, str(REPO / "benchmarks"))  # the benchmarks import each other by name
peers = importlib.import_module("peers")


def test_vllm_benchmark_serving_result_is_read_per_request() -> None:
    figures, failed = peers.read_vllm_result(DATA / "vllm-0.7.3-result.json")
    assert failed == 1  # its error, and no first token
    assert [round(x, 3) for x in figures["ttft"]] == [54.47, 55.004, 54.225]  # s -> ms
    assert len(figures["itl"]) == 12  # four gaps of each of three requests
    assert all(9.0 < x < 10.6 for x in figures["itl"]), figures["itl"]
    assert figures["tpot"] == pytest.approx(
        [sum(g) / 4 for g in ([9.0069, 10.2998, 9.5716, 10.5351], [9.2832, 10.3090, 9.6840,
         10.4405], [9.2709, 10.3085, 9.6837, 10.4410])], abs=1e-3
    )  # fmt: skip


def test_inference_perf_lifecycle_metrics_are_read_per_request(tmp_path: Path) -> None:
    stage = tmp_path / "stage_0"
    stage.mkdir()
    (stage / "per_request_lifecycle_metrics.json").write_bytes(
        (DATA / "per_request_lifecycle_metrics.json").read_bytes()
    )
    figures, failed = peers.read_inference_perf(tmp_path)
    assert failed == 1  # its error, and no token times
    # first token time − start time, ms: 58971.407409303 − 58971.352250945, ...
    assert figures["ttft"] == pytest.approx([55.158, 52.072], abs=1e-3)
    assert len(figures["itl"]) == 6 and all(9.0 < x < 10.7 for x in figures["itl"])
    assert figures["tpot"] == pytest.approx(
        [(58971.436629233 - 58971.407409303) * 1e3 / 3, (58971.505073049 - 58971.475689209)
         * 1e3 / 3], abs=1e-3
    )  # fmt: skip
    assert peers.read_inference_perf(tmp_path / "none") == (
        {"ttft": [], "itl": [], "tpot": []},
        0,
    )
