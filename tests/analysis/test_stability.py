"""Spec §13 stage conditions as rules: recovery after each burst
(candidate, release), zero unrecovered device faults (release), the SLA as `slo` rules,
the stage rules files over the default (`extends`), and the soak's conditions naming
them. Hand-built run folders with known bursts and faults (integer ns)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from analysis.analyze import analyze, write_outputs
from analysis.errors import RulesError
from analysis.judge.rules import DEFAULT_RULES, load_rules
from analysis.report import write_report
from calculet_drivers.soak.judge import STAGE_RULES, _rule_condition, endurance_note
from calculet_drivers.soak.stage import load_stage
from tests.analysis.test_report import Page
from tests.support.runs import MS, WALL0, RunBuilder, device_row, request

S = 1000 * MS


def _rules(tmp: Path, *rules: dict[str, Any], name: str = "rules.yaml") -> str:
    """A rules file over the default, with only the rules given enabled besides it."""
    path = tmp / name
    path.write_text(json.dumps({"schema": "calculet-acceptance-rules/v1",
                                "extends": str(DEFAULT_RULES), "rules": list(rules)}))  # fmt: skip
    return str(path)


def _verdicts(run: str, rules: str, kind: str) -> list[dict[str, Any]]:
    doc = analyze(run, rules_path=rules).document
    return [v for v in doc["verdicts"] if v["kind"] == kind]


def _burst_run(root: Path, slow_after: dict[int, int], *, scale: float | None = None) -> str:
    """Poisson-like background every second for 100 s at TTFT 50 ms; bursts of 6 at
    30 s and 70 s (their own requests end 2 s after). After a burst at B s, the
    background starting in [B, B + slow_after[B]) has TTFT 400 ms."""
    b = RunBuilder(root)
    for i in range(100):
        t0 = i * S
        burst_at = next((at for at in slow_after if at <= i < at + slow_after[at]), None)
        ttft = 400 * MS if burst_at is not None else 50 * MS
        b.add(request(f"bg{i:03d}", t0=t0, ttft=ttft, arrival="poisson", concurrency=None,
                      cell="soak:candidate:short"))  # fmt: skip
    for at in slow_after:
        for j in range(6):
            b.add(request(f"b{at}-{j}", t0=at * S + j * MS, ttft=(1500 + 80 * j) * MS,
                          arrival="burst", concurrency=6, cell="soak:candidate:burst",
                          ext={"burst_id": f"run.burst.{at:05d}"}))  # fmt: skip
    if scale is not None:
        b.trace("resources", [{"wall_ns": WALL0 + k * S, "mono_ns": k * S, "time_scale": scale}
                              for k in range(0, 100, 10)])  # fmt: skip
    b.complete_index()
    return b.write()


BURST_RULE = {"id": "burst_recovery", "kind": "burst_recovery", "max_recovery_s": 10,
              "baseline_s": 20, "tolerance": 0.5, "settle_requests": 3}  # fmt: skip


def test_a_burst_that_recovers_late_fails_naming_it_and_one_in_time_passes(
    tmp_path: Path,
) -> None:
    run = _burst_run(tmp_path / "run", {30: 4, 70: 15})
    [v] = _verdicts(run, _rules(tmp_path, BURST_RULE), "burst_recovery")
    assert v["status"] == "fail" and v["class"] == "correctness", v
    assert "burst run.burst.00070" in v["reason"] and "1 of 2 bursts" in v["reason"]
    by = {d["burst"]: d for d in v["details"]}
    # burst at 30 s: the background from 34 s on is back at 50 ms (3 in a row): 4 s
    assert by["run.burst.00030"]["recovery_s"] == pytest.approx(4.0, abs=0.01)
    assert by["run.burst.00030"]["baseline_ms"] == pytest.approx(50.0)
    assert by["run.burst.00070"]["recovery_s"] == pytest.approx(15.0, abs=0.01)
    assert by["run.burst.00070"]["size"] == 6
    [ok] = _verdicts(run, _rules(tmp_path, {**BURST_RULE, "max_recovery_s": 20}, name="b.yaml"),
                     "burst_recovery")  # fmt: skip
    assert ok["status"] == "pass" and ok["observed"] == pytest.approx(15.0, abs=0.01), ok


def test_burst_recovery_is_in_server_seconds_and_needs_a_burst(tmp_path: Path) -> None:
    # a rehearsal at time scale 0.5: 4 real seconds are 8 server seconds
    run = _burst_run(tmp_path / "scaled", {30: 4}, scale=0.5)
    [v] = _verdicts(run, _rules(tmp_path, BURST_RULE), "burst_recovery")
    assert v["details"][0]["recovery_s"] == pytest.approx(8.0, abs=0.01)
    assert v["status"] == "pass"
    # the background never settles before the end: not recovered
    run = _burst_run(tmp_path / "never", {90: 10})
    [v] = _verdicts(run, _rules(tmp_path, BURST_RULE), "burst_recovery")
    assert v["status"] == "fail" and "not recovered" in v["reason"], v
    # no burst: not evaluated, never passed
    b = RunBuilder(tmp_path / "none")
    for i in range(10):
        b.add(request(f"r{i}", t0=i * S, arrival="poisson", concurrency=None))
    [v] = _verdicts(b.complete_index().write(), _rules(tmp_path, BURST_RULE), "burst_recovery")
    assert v["status"] == "not_evaluated" and v["reason"].startswith("no data: no burst")


def _ev(name: str, mono: int, **detail: Any) -> dict[str, Any]:
    return {"wall_ns": WALL0 + mono, "mono_ns": mono, "event": name, "request_id": None,
            "job_id": None, "seq_id": None, "step_index": None, "kind": None,
            "generation": 1, "detail": detail or None}  # fmt: skip


def _finished(rid: str, mono: int) -> dict[str, Any]:
    return {**_ev("finished", mono), "request_id": rid}


def _fault_run(root: Path, events: list[dict[str, Any]]) -> str:
    b = RunBuilder(root)
    for i in range(10):
        b.add(request(f"r{i}", t0=i * S, arrival="poisson", concurrency=None))
    b.trace("server_events", sorted(events, key=lambda e: e["mono_ns"]))
    return b.complete_index().write()


FAULT_RULE = {"id": "device_faults", "kind": "device_faults", "max_recovery_s": 30}


def test_an_unrecovered_device_fault_fails_and_recovered_ones_pass(tmp_path: Path) -> None:
    recovered = [
        # rc=17 with no state change: recovered by the next request served (2 s)
        _ev("runtime_error", 10 * S, rc=17), _finished("r3", 12 * S),
        # rc=18: recovering, then ready 5 s later (one episode of two events)
        _ev("runtime_error", 20 * S, rc=18),
        _ev("state_change", 20 * S + 1, **{"from": "ready", "to": "recovering"}),
        _finished("r5", 22 * S),  # the state changed: a request served is not recovery
        _ev("state_change", 25 * S, **{"from": "recovering", "to": "ready"}),
    ]  # fmt: skip
    run = _fault_run(tmp_path / "ok", recovered)
    [v] = _verdicts(run, _rules(tmp_path, FAULT_RULE), "device_faults")
    assert v["status"] == "pass" and v["n"] == 2, v
    assert [d["recovery_s"] for d in v["details"]] == [pytest.approx(2.0), pytest.approx(5.0)]
    assert v["details"][1]["recovered_by"] == "state_change to ready"

    broken = [*recovered, _ev("reset", 40 * S),
              _ev("state_change", 40 * S + 1, **{"from": "ready", "to": "failed"})]  # fmt: skip
    run = _fault_run(tmp_path / "bad", broken)
    [v] = _verdicts(run, _rules(tmp_path, FAULT_RULE), "device_faults")
    assert v["status"] == "fail" and v["observed"] == 1 and v["class"] == "correctness", v
    assert "1 unrecovered device fault(s) of 3" in v["reason"]
    assert "never recovered" in v["reason"] and "reset" in v["reason"]
    # too slow is not recovered either
    slow = [_ev("state_change", 1 * S, **{"from": "ready", "to": "resetting"}),
            _ev("state_change", 50 * S, **{"from": "resetting", "to": "ready"})]  # fmt: skip
    [v] = _verdicts(_fault_run(tmp_path / "slow", slow), _rules(tmp_path, FAULT_RULE),
                    "device_faults")  # fmt: skip
    assert v["status"] == "fail" and "recovered only after 49 s" in v["reason"], v


def test_faults_while_a_fault_is_armed_are_the_fault_matrix_s(tmp_path: Path) -> None:
    events = [_ev("fault_armed", 1 * S, scenario="reset_failure"), _ev("reset", 2 * S),
              _ev("state_change", 2 * S + 1, **{"from": "ready", "to": "failed"}),
              _ev("fault_cleared", 3 * S)]  # fmt: skip
    run = _fault_run(tmp_path / "armed", events)
    [v] = _verdicts(run, _rules(tmp_path, FAULT_RULE), "device_faults")
    assert v["status"] == "pass" and "1 while a fault was armed" in v["reason"], v
    counted = _rules(tmp_path, {**FAULT_RULE, "exclude_injected": False}, name="all.yaml")
    [v] = _verdicts(run, counted, "device_faults")
    assert v["status"] == "fail", v


def test_the_stage_rules_files_extend_the_default(tmp_path: Path) -> None:
    default, _ = load_rules()
    for stage, kinds in (("candidate", {"slo", "burst_recovery", "leaks"}),
                         ("release", {"device_faults", "burst_recovery", "leaks"})):  # fmt: skip
        st = load_stage(stage)
        assert st.rules is not None and Path(st.rules).name == f"soak-{stage}.yaml"
        rules, text = load_rules(st.rules)
        assert kinds <= {r.kind for r in rules.rules if r.enabled}, stage
        # every default rule is there, in the default's order, then the stage's own
        assert [r.id for r in rules.rules][: len(default.rules)] == [r.id for r in default.rules]
        assert rules.infrastructure == default.infrastructure
        assert "extending default.yaml" in text  # verdict.json hashes both files
    # a rule of the base's id replaces it in place; a newer section key overrides
    child = tmp_path / "child.yaml"
    child.write_text(json.dumps({
        "schema": "calculet-acceptance-rules/v1", "extends": str(DEFAULT_RULES),
        "infrastructure": {"max_send_lag_p99_ms": 50.0},
        "rules": [{"id": "error_rate", "kind": "error_rate", "max_error_rate": 0.01}],
    }))  # fmt: skip
    rules, _ = load_rules(child)
    ids = [r.id for r in rules.rules]
    assert ids == [r.id for r in default.rules]
    assert rules.rules[ids.index("error_rate")].max_error_rate == 0.01  # type: ignore[union-attr]
    assert rules.infrastructure.max_send_lag_p99_ms == 50.0
    saturated = default.infrastructure.max_saturated_fraction
    assert rules.infrastructure.max_saturated_fraction == saturated
    # one level only
    grand = tmp_path / "grand.yaml"
    grand.write_text(json.dumps({"schema": "calculet-acceptance-rules/v1",
                                 "extends": "child.yaml"}))  # fmt: skip
    with pytest.raises(RulesError, match="one level only"):
        load_rules(grand)


def test_the_soak_names_each_stage_rule_as_a_condition() -> None:
    assert set(STAGE_RULES) == {"SLA held", "recovery after each burst",
                                "zero unrecovered device faults"}  # fmt: skip
    v = {"rule": "sla_ttft", "threshold": "ttft_ms p99 ≤ 900", "observed": 1.0, "n": 5}
    assert _rule_condition([{**v, "status": "pass"}])[0] is True
    assert _rule_condition([{**v, "status": "pass"}, {**v, "status": "fail"}])[0] is False
    unset = {**v, "status": "not_evaluated", "reason": "not configured: set max_ms"}
    ok, expected, observed = _rule_condition([unset])
    assert ok is None and "sla_ttft: ttft_ms p99 ≤ 900" in expected
    assert observed["rules"][0]["reason"] == "not configured: set max_ms"


def _endurance_run(root: Path, *, fragmentation: bool, scale: float | None = None) -> str:
    """Two hours (real) of device rows every minute: chip 0 warms by 2 °C per hour from
    40 °C, chip 1 stays at 41 °C; resources every minute: free KV blocks fall from 100
    by 20 per hour, the largest free extent stays at 4096 tokens."""
    b = RunBuilder(root)
    for i in range(10):
        b.add(request(f"r{i}", t0=i * S, arrival="poisson", concurrency=None))
    minutes = range(121)
    b.trace("device", [device_row(m * 60 * S, (40.0 + 2 * m / 60, 41.0)) for m in minutes])
    rows: list[dict[str, Any]] = []
    for m in minutes:
        row: dict[str, Any] = {"wall_ns": WALL0 + m * 60 * S, "mono_ns": m * 60 * S,
                               "time_scale": scale}  # fmt: skip
        if fragmentation:
            row |= {"kv_free_blocks": 100 - round(20 * m / 60),
                    "kv_largest_free_extent_tokens": 4096}  # fmt: skip
        rows.append(row)
    b.trace("resources", rows)
    return b.complete_index().write()


def test_endurance_reports_temperature_drift_and_fragmentation_trends(tmp_path: Path) -> None:
    run = _endurance_run(tmp_path / "frag", fragmentation=True)
    doc = analyze(run).document["endurance"]
    c0, c1 = doc["temperature"]["chips"]
    assert c0["trend"] == "rising" and c0["slope"] == pytest.approx(2.0, rel=1e-3)
    # first and last tenth after a tenth of warmup: minutes 12..22 and 111..120
    assert c0["change"] == pytest.approx(2 * (115.5 - 17) / 60, abs=0.05)
    assert c1["trend"] == "flat" and c1["slope"] == 0 and c1["change"] == 0
    frag = doc["fragmentation"]
    assert frag["reported"] is True
    blocks = frag["series"]["kv_free_blocks"]
    assert blocks["trend"] == "falling" and blocks["slope"] == pytest.approx(-20, rel=0.05)
    assert blocks["max"] == 100 and blocks["min"] == 60
    assert frag["series"]["kv_largest_free_extent_tokens"]["trend"] == "flat"
    note = endurance_note(doc)
    assert note.startswith("endurance (§13): temperature: chip 0 ")
    assert "slope 2.0 °C/h (rising)" in note, note
    # the first and last tenth after the warmup: minutes 12-21 and 111-120
    assert "kv_free_blocks 94.5 → 61.5 blocks, slope -20.0/h (falling)" in note, note
    write_outputs(analyze(run), run)
    page = Page(Path(write_report(run)).read_text())
    assert page.tables["endurance_temperature"][0][0] == "0"
    assert page.tables["endurance_temperature"][0][-1] == "rising"
    assert page.tables["endurance_fragmentation"][0][:2] == ["kv_free_blocks", "blocks"]

    # a rehearsal at time scale 0.5: two real hours are four server hours
    run = _endurance_run(tmp_path / "scaled", fragmentation=False, scale=0.5)
    doc = analyze(run).document["endurance"]
    assert doc["time_scale"] == 0.5
    assert doc["temperature"]["chips"][0]["slope"] == pytest.approx(1.0, rel=1e-3)
    assert doc["fragmentation"]["reported"] is False
    assert "reports no KV fragmentation signal" in doc["fragmentation"]["note"]
    write_outputs(analyze(run), run)
    text = Page(Path(write_report(run)).read_text()).sections["endurance"]
    assert "reports no KV fragmentation signal" in text


def test_fragmentation_series_are_read_from_metrics_and_admin_state() -> None:
    from calculet_load.schema.prometheus import resource_fields
    from calculet_load.target.resources import _from_state

    got = resource_fields({"calculet_kv_free_blocks": 12.0,
                           "calculet_kv_largest_free_extent_tokens": 640.0})  # fmt: skip
    assert got == {"kv_free_blocks": 12, "kv_largest_free_extent_tokens": 640}
    state = _from_state({"kv": {"free_blocks": 3, "largest_free_extent_tokens": 48}})
    assert (state["kv_free_blocks"], state["kv_largest_free_extent_tokens"]) == (3, 48)


@pytest.mark.parametrize(
    ("rise_mib", "flat"),
    [(2.0, True), (20.0, False)],
    ids=["allocator-creep", "leak"],
)
def test_client_memory_is_judged_on_its_slope_and_its_rise(rise_mib: float, flat: bool) -> None:
    """A 36 s stage: a 2 MiB creep is 200 MiB/h (under the 256 gate) or more, but it is
    under the allocators' step (8 MiB) and no trend; a 20 MiB rise is a leak either way."""
    from calculet_drivers.soak.judge import _client_slope, memory_flat
    from calculet_drivers.soak.stage import PassConditions

    rows = [{"mono_ns": int(i * 0.5e9), "rss_bytes": int((170 + rise_mib * i / 72) * 2**20)}
            for i in range(73)]  # fmt: skip
    seg = _client_slope(rows)
    assert seg["span_real_s"] == 36.0
    # the fit spans the 90 % after the warmup
    assert seg["rise_mib"] == pytest.approx(rise_mib * 0.9, rel=0.02)
    assert seg["slope_mib_per_h"] == pytest.approx(rise_mib / 36 * 3600, rel=0.02)
    assert memory_flat(seg, PassConditions()) is flat
    # a stage that asks for a stricter floor judges the creep by its slope alone
    assert memory_flat(seg, PassConditions(client_rss_min_rise_mib=0)) is (rise_mib < 2.5)
