"""The metrics panel live: a Locust master + 2 workers against the simulator, scraped.

One open-loop run (Poisson, a mix with a §6.1 boundary prompt that the simulator
refuses with 400) serves every test here: the master's `--metrics-port` is scraped while
the run goes on, the master samples the simulator's `/metrics` and process into the run
folder, and the Grafana dashboard's PromQL is checked against the series the two
exporters actually produced.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from tests.support import dashboard
from tests.support.locustproc import LocustRun
from tests.support.ports import free_port
from tests.support.simproc import SimProcess

pytestmark = pytest.mark.timeout(180)

MIX = """\
schema: calculet-mix/v1
name: live-metrics
entries:
  - {name: short, weight: 6, prompt_tokens: 128, max_tokens: 32}
  - {name: medium, weight: 3, prompt_tokens: 512, max_tokens: 64}
  - {name: boundary, weight: 1, prompt_tokens: 40959, max_tokens: 32}
"""
RATE = 16.0


@dataclass
class Live:
    during: list[Sample]  # the master's exposition, scraped while the run went on
    scrapes: int
    sim_text: str
    run: LocustRun
    sim: SimProcess
    index: dict[str, Any]


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as r:
        return str(r.read().decode())


def _samples(text: str) -> list[Sample]:
    return [s for fam in text_string_to_metric_families(text) for s in fam.samples]


def _sum(samples: list[Sample], name: str, **labels: str) -> float:
    return sum(
        s.value
        for s in samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    tmp = tmp_path_factory.mktemp("live-metrics")
    sim = SimProcess(tmp, "--profile", "b16", "--time-scale", "0.01")
    mix = tmp / "mix.yaml"
    mix.write_text(MIX)
    port = free_port()
    run = LocustRun(
        tmp,
        sim.url,
        [
            *("--arrival", "poisson", "--rate", str(RATE), "--seed", "5"),
            *("--mix", str(mix), "--model", "sim-model", "--start-delay", "1"),
            *("--metrics-port", str(port), "--metrics-host", "127.0.0.1"),
            *("--scrape-interval", "0.5", "-u", "2", "-r", "2"),
            *("--exit-code-on-error", "0"),  # the refused boundary prompts are by design
        ],
        workers=2,
        run_time_s=12.0,
    )
    try:
        run.start()
        url = f"http://127.0.0.1:{port}/metrics"
        during: list[Sample] = []
        scrapes = 0
        deadline = time.monotonic() + 60
        # scrape until both workers have reported some of each outcome
        while time.monotonic() < deadline and run.master.poll() is None:
            try:
                during = _samples(_get(url))
                scrapes += 1
            except OSError:
                pass
            procs = {s.labels.get("process") for s in during if "in_flight" in s.name}
            ok = _sum(during, "calculet_client_requests_total", outcome="ok")
            if (
                procs >= {"w00", "w01"}
                and ok >= 40
                and _sum(during, "calculet_client_errors_total")
            ):
                break
            time.sleep(0.5)
        assert run.wait() == 0, run.log_text()
        yield Live(during, scrapes, _get(f"{sim.url}/metrics"), run, sim, run.index())
    finally:
        run.stop()
        sim.stop()


def test_the_master_serves_the_client_series_while_the_run_goes_on(live: Live) -> None:
    s = live.during
    assert live.scrapes >= 2 and s, live.run.log_text()
    # every ended request in one outcome; the boundary prompt is refused (4xx) by design
    ok = _sum(s, "calculet_client_requests_total", outcome="ok")
    bad = _sum(s, "calculet_client_requests_total", outcome="4xx")
    assert ok >= 40 and bad >= 1
    assert _sum(s, "calculet_client_errors_total", error_class="http_4xx") == bad
    labels = {
        tuple(sorted(x.labels.items()))
        for x in s
        if x.name == "calculet_client_requests_total" and x.labels["outcome"] == "ok"
    }
    for lab in map(dict, labels):  # the bounded label sets: open loop, the mix's buckets
        assert lab["model"] == "sim-model" and lab["concurrency"] == "open", lab
        # 128/32 and 512/64: 64 output tokens fall in the bucket up to 256
        assert (lab["prompt_bucket"], lab["output_bucket"]) in {("128", "32"), ("512", "256")}
    # latency histograms hold exactly the successful requests of the same snapshot
    for name in ("ttft", "e2e"):
        assert _sum(s, f"calculet_client_{name}_seconds_count") == ok
    ttft = _sum(s, "calculet_client_ttft_seconds_sum") / ok
    e2e = _sum(s, "calculet_client_e2e_seconds_sum") / ok
    tpot_n = _sum(s, "calculet_client_tpot_seconds_count")
    tpot = _sum(s, "calculet_client_tpot_seconds_sum") / tpot_n
    assert 0 < ttft < e2e < 60 and 0 < tpot < e2e, (ttft, tpot, e2e)
    inf = _sum(s, "calculet_client_ttft_seconds_bucket", le="+Inf")
    assert inf == ok
    # tokens: the simulator generates exactly max_tokens; prompts are exact
    for p, o, prompt, out in (("128", "32", 128, 32), ("512", "256", 512, 64)):
        sel = {"prompt_bucket": p, "output_bucket": o}
        n_ok = _sum(s, "calculet_client_requests_total", outcome="ok", **sel)
        n_all = _sum(s, "calculet_client_requests_total", **sel)
        assert n_ok > 0
        assert _sum(s, "calculet_client_output_tokens_total", **sel) == n_ok * out
        assert _sum(s, "calculet_client_prompt_tokens_total", **sel) == n_all * prompt
    # open loop: every arrival was sent on its schedule (lag measured), none dropped here
    assert _sum(s, "calculet_client_send_lag_seconds_count") >= ok + bad
    assert _sum(s, "calculet_client_dropped_arrivals_total") == 0
    assert _sum(s, "calculet_client_late_arrivals_total") >= 0
    assert _sum(s, "calculet_client_ttft_from_intended_seconds_count") == ok
    # the client watches itself: each worker's loop lag every second, its CPU, in-flight
    assert _sum(s, "calculet_client_loop_lag_seconds_count") >= 2
    assert _sum(s, "calculet_client_loop_lag_seconds_bucket", le="1.0") >= 1
    for w in ("w00", "w01"):
        assert 0 <= _sum(s, "calculet_client_requests_in_flight", process=w) <= 256
        assert 0 <= _sum(s, "calculet_client_cpu_percent", process=w) <= 200
    assert _sum(s, "calculet_client_target_rate") == RATE
    run_id = live.index["run_id"]
    assert _sum(s, "calculet_client_run_info", run_id=run_id, arrival="poisson") == 1


def test_server_series_and_process_samples_land_in_the_run_folder(live: Live) -> None:
    server = live.run.run_dir / "server"
    metrics = [json.loads(x) for x in (server / "metrics.jsonl").read_text().splitlines()]
    process = [json.loads(x) for x in (server / "process.jsonl").read_text().splitlines()]
    # about two a second for ~13 s of run (start delay included), each one complete
    assert len(metrics) >= 15 and all(r["ok"] for r in metrics), metrics[-1]
    assert all(r["url"] == f"{live.sim.url}/metrics" for r in metrics)
    first, last = metrics[0]["samples"], metrics[-1]["samples"]
    gauges = ("calculet_jobs_in_flight", "calculet_kv_allocated_tokens")
    gauges += ("calculet_buffer_pool_leased", 'calculet_chip_temperature_c{chip="0"}')
    assert all(g in r["samples"] for r in metrics for g in gauges)
    finished = last["calculet_requests_finished_total"] - first["calculet_requests_finished_total"]
    sent = sum(w["requests"] for w in live.index["workers"])  # every sent request
    assert 0 < finished <= sent
    assert max(r["samples"]["calculet_sequences_active"] for r in metrics) >= 1
    assert any(k.startswith("calculet_runtime_phase_ms_bucket") for k in last)
    # the simulator's own process, found by its port on this host
    assert {r["pid"] for r in process} == {live.sim.pid}
    assert len(process) >= 15 and all(r["alive"] for r in process)
    assert all(r["rss_bytes"] > 0 and r["threads"] >= 1 and r["fds"] > 0 for r in process)
    walls = [r["wall_ns"] for r in process]
    assert walls == sorted(walls)
    index_wall = (live.index["started_wall_ns"], live.index["ended_wall_ns"])
    assert index_wall[0] <= walls[0] and walls[-1] >= index_wall[1] - 1_000_000_000


def test_the_dashboard_reads_only_series_the_exporters_produce(live: Live) -> None:
    produced = {x.name for x in live.during} | {x.name for x in _samples(live.sim_text)}
    wanted = dashboard.referenced_series(dashboard.load())
    assert wanted, "the dashboard references no series"
    assert not wanted - produced, sorted(wanted - produced)
