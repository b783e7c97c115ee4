"""Infrastructure validity (spec §15 exit 3): was the measurement itself sound?

Neither a product pass nor a product fail: a run that fails one of these is to be rerun.
Checks (thresholds in the rules file's `infrastructure:` section, None disables one):

    index_complete    client/index.json says the run completed, no worker went missing,
                      no sink lost a part
    client_saturation share of sent records the self-watch saw saturated
    clock_complete    share of successes with incomplete client stamps
    network_break     share of sent records inside a network break, declared or detected
                      (analysis.tables.netbreaks; a server restart is not one)
    send_lag          open loop: P99 of (actual − intended send time), stale retries apart
    answered          some request got an answer from the target (an HTTP status): a run
                      whose every request failed before one (refused, no route, TLS, a
                      closed or silent connection) or sent none measured nothing of it

Without the data a check needs (a probe has no index, no self-watch) it is
`not_evaluated`, which does not make the run invalid.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow.compute as pc

from analysis.judge.evidence import Evidence, not_evaluated, verdict_for
from analysis.judge.rules import InfrastructureRules
from analysis.judge.verdict import RuleVerdict, Status
from analysis.stats.quantiles import quantile
from analysis.tables.quality import QualityReport

__all__ = ["check_infrastructure"]


@dataclass(frozen=True, slots=True)
class _Check:
    """An infrastructure check as the verdict constructors see a rule."""

    id: str
    kind: str = "infrastructure"


def _v(
    rule: str,
    status: Status,
    observed: Any,
    threshold: Any,
    n: int,
    reason: str,
    details: tuple[dict[str, Any], ...] = (),
) -> RuleVerdict:
    return verdict_for(_Check(rule), status, observed, threshold, n, reason, details)


def _not_evaluated(rule: str, reason: str, threshold: Any = None, n: int = 0) -> RuleVerdict:
    return not_evaluated(_Check(rule), reason, threshold=threshold, n=n)


def _index(ev: Evidence, rules: InfrastructureRules, rid: str) -> RuleVerdict:
    index = ev.run.index
    if not rules.require_complete_index:
        return _not_evaluated(rid, "disabled in the rules file")
    if index is None:
        return _not_evaluated(
            rid,
            "no data: no client/index.json (a probe or a hand-made folder); completeness "
            "cannot be checked",
            threshold="complete",
        )
    workers = [w for w in index.get("workers") or [] if isinstance(w, dict)]
    missing = [str(w.get("worker")) for w in workers if w.get("status") == "missing"]
    sinks = [(str(w.get("worker")), w.get("sink") or {}) for w in workers]
    lost = [f"{name}: {e}" for name, sink in sinks for e in sink.get("errors", [])]
    quarantined = sum(int(sink.get("quarantined") or 0) for _, sink in sinks)
    unwritten = sum(int(sink.get("lost") or 0) for _, sink in sinks)
    status = str(index.get("status"))
    problems = []
    if status != "complete":
        problems.append(f"status is {status!r}")
    if missing:
        problems.append(f"worker(s) missing: {', '.join(missing)}")
    if quarantined or unwritten:
        files = [f"{name}/{f}" for name, sink in sinks for f in sink.get("quarantine_files", [])]
        problems.append(
            f"{quarantined + unwritten} row(s) not in the Parquet parts "
            f"({quarantined} quarantined in client/{', client/'.join(files) or '-'}, "
            f"{unwritten} lost)"
        )
    if lost:
        problems.append(f"sink errors: {'; '.join(lost[:3])}")
    details = tuple({"worker": w.get("worker"), "status": w.get("status")} for w in workers)
    if problems:
        return _v(
            rid,
            Status.FAIL,
            status,
            "complete",
            len(workers),
            f"client/index.json: {', '.join(problems)}: records may be missing; rerun "
            "(check the workers' logs for why they stopped)",
            details,
        )
    return _v(rid, Status.PASS, status, "complete", len(workers), "every worker reported")


def _fraction(
    rid: str,
    count: int,
    n: int,
    limit: float | None,
    what: str,
    fix: str,
    no_data: str | None,
    evidence: str = "",
) -> RuleVerdict:
    if limit is None:
        return _not_evaluated(rid, "disabled in the rules file", n=n)
    if no_data is not None:
        return _not_evaluated(rid, f"no data: {no_data}", limit, n)
    if n == 0:
        return _not_evaluated(rid, "no data: no records to judge", limit)
    share = count / n
    seen = f"{count} of {n} {what} ({share:.2%}{evidence}); allowed {limit:.2%}"
    if share > limit:
        return _v(rid, Status.FAIL, share, limit, n, f"{seen}: {fix}")
    return _v(rid, Status.PASS, share, limit, n, seen)


# the saturated self-watch samples a client_saturation verdict names, worst first
SATURATED_NAMED = 3


def _saturated_seen(q: QualityReport) -> str:
    """What the self-watch saw, for the client_saturation verdict: how many of its judged
    samples were saturated, and the worst (they come longest loop lag first) with their
    lag and CPU; then the records judged by their own bounds (analysis.tables.saturation:
    a kernel-stamped record under a loop-lag-only sample, a record whose own bounds
    passed the limit) and the closed-loop cells the client held."""
    samples, judged = q.saturated_samples, q.selfwatch_samples - q.selfwatch_warmup_samples
    spared, own = q.lag_judged_by_own_bounds, q.saturated_by_own_bounds
    text = ""
    if samples:
        worst = samples[:SATURATED_NAMED]
        named = ", ".join(
            f"{x['worker']} loop lag {float(x['loop_lag_ms']):.1f} ms at "
            f"{float(x['cpu_percent']):.0f} % CPU"
            for x in worst
        )
        text = f"; {len(samples)} of {judged} self-watch samples saturated: {named}"
    if spared:
        text += (
            f"; {spared} records under a sample that saw only loop lag had the kernel's "
            "stamps, which no loop delays: judged by their own bounds (a closed loop's "
            "by its cell's hold)"
        )
    if own:
        text += (
            f"; {own} records flagged by their own bounds (send lag, first-token late bound "
            "or start to sent) or their closed-loop cell's hold"
        )
    if held := [h for h in q.closed_loop_holds if h["held"]]:
        named = ", ".join(
            f"{h['cell']} on {h['worker']} (users held {h['mean_hold_ms']:.1f} ms a request, "
            f"{h['held_share']:.1%} of their time)"
            for h in held[:SATURATED_NAMED]
        )
        text += f"; {len(held)} closed-loop cells held by the client: {named}"
    return text


def _breaks_seen(breaks: tuple[dict[str, Any], ...]) -> str:
    found = [b for b in breaks if b.get("source") == "detected"]
    aside = sum(b.get("source") == "server_restart" for b in breaks)
    also = f"; {aside} interval(s) set aside: the server restarted" if aside else ""
    if not found:
        return "none detected" + also
    first = found[0]["evidence"][0] if found[0]["evidence"] else found[0]["reason"]
    return f"{len(found)} detected, first: {first}{also}"


def _send_lag(ev: Evidence, limit: float | None, rid: str) -> RuleVerdict:
    if limit is None:
        return _not_evaluated(rid, "disabled in the rules file")
    t = ev.table
    lag = t.column("ext.send_lag_ms")
    open_loop = pc.and_(pc.is_valid(lag), pc.invert(pc.fill_null(t.column("ext.dropped"), False)))
    # A stale retry (the kept-alive connection was closed or reset under the request:
    # measure.connections `stale`) was first sent on schedule; its send is timed from the retry, so
    # its lag is the dead connection's wait (a server that restarted), not the client's.
    retry = pc.fill_null(t.column("ext.stale_retry"), False)
    retries = int(pc.sum(pc.and_(open_loop, retry).cast("int64")).as_py() or 0)
    open_loop = pc.and_(open_loop, pc.invert(retry))
    values = np.asarray(pc.filter(lag, open_loop).to_numpy(zero_copy_only=False), dtype=float)
    if values.size == 0:
        return _not_evaluated(rid, "no data: no open-loop arrivals", limit)
    p99 = quantile(values, 0.99)
    assert p99 is not None
    seen = f"send lag P99 {p99:.3f} ms over {values.size} arrivals; allowed {limit:g} ms"
    if retries:
        seen += f" ({retries} stale retries left out: their first send kept the schedule)"
    if p99 > limit:
        return _v(
            rid,
            Status.FAIL,
            p99,
            limit,
            values.size,
            f"{seen}: the client could not keep the schedule; add workers or lower the rate",
        )
    return _v(rid, Status.PASS, p99, limit, values.size, seen)


def _answered(ev: Evidence, rid: str) -> RuleVerdict:
    t = ev.table
    sent = pc.invert(pc.fill_null(t.column("ext.dropped"), False))
    n = int(pc.sum(sent.cast("int64")).as_py() or 0)
    answered = pc.and_(sent, pc.is_valid(t.column("result.http_status")))
    got = int(pc.sum(answered.cast("int64")).as_py() or 0)
    if got:
        return _v(rid, Status.PASS, got, 1, n, f"{got} of {n} sent requests got an answer")
    classes = pc.value_counts(pc.filter(t.column("ext.error_class"), sent)).to_pylist()
    seen = ", ".join(f"{c['values']} {c['counts']}" for c in classes if c["values"])
    why = f"none of {n} sent requests got an answer ({seen})" if n else "no request was sent"
    return _v(rid, Status.FAIL, got, 1, n, f"{why}: the run measured nothing of the target")


def check_infrastructure(
    ev: Evidence, rules: InfrastructureRules, *, prefix: str = ""
) -> list[RuleVerdict]:
    """Every infrastructure check on one run; ids carry `prefix` (e.g. "baseline.")."""
    q = ev.quality
    no_watch = None
    if q.selfwatch_samples == 0:
        no_watch = "no self-watch samples in the run (a probe has none)"
    elif q.workers_without_selfwatch:
        no_watch = f"no self-watch samples from {', '.join(q.workers_without_selfwatch)}"
    return [
        _index(ev, rules, f"{prefix}index_complete"),
        _fraction(
            f"{prefix}client_saturation",
            q.saturated,
            q.sent,
            rules.max_saturated_fraction,
            "sent records ran while the client was saturated",
            "the load generator was the bottleneck; add workers or lower the load, then rerun",
            no_watch,
            _saturated_seen(q),
        ),
        _fraction(
            f"{prefix}clock_complete",
            q.clock_incomplete_successes,
            q.successes,
            rules.max_clock_incomplete_fraction,
            "successes have incomplete client stamps",
            "fix the client's clock stamping (see the records' client_ns) and rerun",
            None,
        ),
        dataclasses.replace(
            _fraction(
                f"{prefix}network_break",
                q.network_break_records,
                q.sent,
                rules.max_network_break_fraction,
                "sent records overlap a network break (declared, or detected: "
                + _breaks_seen(q.network_breaks)
                + ")",
                "the network failed during the run; rerun once it is stable",
                None,
            ),
            details=q.network_breaks,
        ),
        _send_lag(ev, rules.max_send_lag_p99_ms, f"{prefix}send_lag"),
        _answered(ev, f"{prefix}answered"),
    ]
