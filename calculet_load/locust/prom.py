"""Prometheus exposition of the load generator's live figures (spec §10.1, client side).

`ClientCollector` reads a `LiveStats` at scrape time: on the Locust master the merge of
every worker's reports, in a local run or on a worker its own. Nothing is kept twice and
nothing is computed on the hot path: the figures are the ones the web UI shows, with
fixed-bound histograms (seconds) for Prometheus. Like every live figure they serve
watching, not reports (DESIGN §1: reports are recomputed from the records).

Series (all `calculet_client_*`; L = model, prompt_bucket, output_bucket, concurrency):

| series | type | labels |
| --- | --- | --- |
| `requests_total` | counter | L, outcome (ok, 4xx, 5xx, timeout, cancel, error) |
| `ttft_seconds`, `tpot_seconds`, `e2e_seconds` | histogram | L (successful requests) |
| `output_tokens_total`, `prompt_tokens_total` | counter | L |
| `errors_total` | counter | error_class |
| `late_arrivals_total`, `dropped_arrivals_total`, `token_count_mismatches_total` | counter | |
| `ttft_from_intended_seconds`, `send_lag_seconds`, `loop_lag_seconds` | histogram | |
| `requests_in_flight`, `cpu_percent` | gauge | process (w00, w01, ...) |
| `target_users`, `target_rate` | gauge | |
| `run_info` | gauge (1) | run_id, arrival, protocol |

`serve` starts the HTTP endpoint on gevent's WSGI server (Locust's processes run gevent);
`install` does both for a Locust process with `--metrics-port`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from calculet_load.locust.livestats import (
    OUTCOMES,
    SERIES_HISTOGRAMS,
    SERIES_LABELS,
    FixedHistogram,
    LiveStats,
)

if TYPE_CHECKING:
    from gevent.pywsgi import WSGIServer

__all__ = ["PREFIX", "ClientCollector", "install", "serve"]

log = logging.getLogger("calculet_load")

PREFIX = "calculet_client_"
_HIST_DOCS = {
    "ttft": "Time to first token (t4 - t0) of successful requests, seconds",
    "tpot": "Time per output token ((t5 - t4) / (n - 1)) of successful requests, seconds",
    "e2e": "End to end (t6 - t0) of successful requests, seconds",
}
_FIXED_DOCS = {
    "ttft_sched": ("ttft_from_intended", "Open loop: TTFT from the intended arrival, seconds"),
    "send_lag": ("send_lag", "Open loop: actual send minus intended arrival, seconds"),
    "loop_lag": ("loop_lag", "Client event-loop lag (self-watch, each second), seconds"),
}

Info = Callable[[], dict[str, Any]]


def _le(bound: float) -> str:
    """An `le` label as Prometheus' clients write it (1.0, 0.005, +Inf)."""
    return "+Inf" if math.isinf(bound) else repr(float(bound))


def _buckets(h: FixedHistogram) -> list[tuple[str, float]]:
    return [(_le(le), float(n)) for le, n in h.cumulative()]


class ClientCollector(Collector):
    """The §10.1 client series from `stats()` (None: before the first run, no samples).

    `info()` gives run_id, arrival, protocol, target_users and target_rate (each may be
    absent)."""

    def __init__(self, stats: Callable[[], LiveStats | None], info: Info | None = None) -> None:
        self.stats = stats
        self.info = info or dict

    def collect(self) -> Iterator[Metric]:
        s = self.stats()
        labels = list(SERIES_LABELS)
        requests = CounterMetricFamily(
            PREFIX + "requests",
            "Requests sent and ended, by outcome (dropped arrivals are not sent)",
            labels=[*labels, "outcome"],
        )
        hists = {
            n: HistogramMetricFamily(f"{PREFIX}{n}_seconds", _HIST_DOCS[n], labels=labels)
            for n in SERIES_HISTOGRAMS
        }
        out_tokens = CounterMetricFamily(
            PREFIX + "output_tokens",
            "Generated tokens received (each request's confirmed total: the server's usage "
            "where it sent one)",
            labels=labels,
        )
        prompt_tokens = CounterMetricFamily(
            PREFIX + "prompt_tokens", "Prompt tokens of the requests sent", labels=labels
        )
        if s is not None:
            for key, series in sorted(s.series.items()):
                values = list(key)
                for outcome in OUTCOMES:
                    if series.outcomes[outcome]:
                        requests.add_metric([*values, outcome], series.outcomes[outcome])
                for name, family in hists.items():
                    h = series.hist[name]
                    if h.count:
                        family.add_metric(values, _buckets(h), sum_value=h.sum)
                out_tokens.add_metric(values, series.output_tokens)
                prompt_tokens.add_metric(values, series.prompt_tokens)
        yield requests
        yield from hists.values()
        yield out_tokens
        yield prompt_tokens

        errors = CounterMetricFamily(
            PREFIX + "errors", "Failed requests by error class", labels=["error_class"]
        )
        counters = {
            "late_arrivals": ("Open-loop arrivals sent later than --late-ms", "late"),
            "dropped_arrivals": ("Open-loop arrivals not sent (in-flight cap full)", "dropped"),
            "token_count_mismatches": (
                "Requests whose per-event token counts disagree with the server's total",
                "count_mismatch",
            ),
        }
        in_flight = GaugeMetricFamily(
            PREFIX + "requests_in_flight",
            "Requests running (active sequences as the client sees them), per process",
            labels=["process"],
        )
        cpu = GaugeMetricFamily(
            PREFIX + "cpu_percent", "Client process CPU (100 = one core)", labels=["process"]
        )
        if s is not None:
            for cls, n in sorted(s.errors.items()):
                errors.add_metric([cls], n)
            for proc, n in sorted(s.in_flight.items()):
                in_flight.add_metric([proc], n)
            for proc, pct in sorted(s.cpu_percent.items()):
                cpu.add_metric([proc], pct)
        yield errors
        for name, (doc, counter) in counters.items():
            yield CounterMetricFamily(
                PREFIX + name, doc, value=s.counters[counter] if s is not None else 0
            )
        yield in_flight
        yield cpu
        for fixed_name, (name, doc) in _FIXED_DOCS.items():
            family = HistogramMetricFamily(f"{PREFIX}{name}_seconds", doc, labels=[])
            if s is not None:
                h = s.fixed[fixed_name]
                family.add_metric([], _buckets(h), sum_value=h.sum)
            yield family
        yield from self._run_info()

    def _run_info(self) -> Iterator[Metric]:
        info = self.info()
        for name, doc in (
            ("target_users", "Locust's target user count (closed loop: concurrency)"),
            ("target_rate", "Open loop: target arrivals per second, all workers"),
        ):
            value = info.get(name)
            if isinstance(value, int | float) and math.isfinite(value):
                yield GaugeMetricFamily(PREFIX + name, doc, value=float(value))
        if info.get("run_id"):
            run = GaugeMetricFamily(
                PREFIX + "run_info",
                "The run being measured (value 1)",
                labels=["run_id", "arrival", "protocol"],
            )
            run.add_metric(
                [str(info["run_id"]), str(info.get("arrival", "")), str(info.get("protocol", ""))],
                1.0,
            )
            yield run


def serve(registry: CollectorRegistry, host: str, port: int) -> WSGIServer:
    """Serve `registry` at http://host:port/metrics (any path) on gevent's WSGI server."""
    from gevent.pywsgi import WSGIServer

    server = WSGIServer((host, port), make_wsgi_app(registry), log=None)
    server.start()
    return server


def install(
    environment: Any,
    live_stats: Callable[[], LiveStats | None],
    current_plan: Callable[[], Any],
) -> WSGIServer:
    """Serve this Locust process's live figures on --metrics-host:--metrics-port (the
    plugin passes where they are, so nothing here imports the plugin)."""
    from calculet_load.locust.worker import OPEN_LOOP, options

    opts = options(environment)

    def info() -> dict[str, Any]:
        plan = current_plan()
        runner = environment.runner
        out: dict[str, Any] = {
            "protocol": opts.protocol,
            "target_users": getattr(runner, "target_user_count", None),
        }
        if plan is not None:
            out.update(run_id=plan.run_id, arrival=plan.arrival)
            if plan.arrival in OPEN_LOOP:
                out["target_rate"] = float(opts.rate)
        return out

    registry = CollectorRegistry()
    registry.register(ClientCollector(live_stats, info))
    try:
        server = serve(registry, opts.metrics_host, int(opts.metrics_port))
    except OSError as exc:  # a user error (port taken, bad address): one line, no traceback
        raise SystemExit(f"calculet-load: --metrics-port {opts.metrics_port}: {exc}") from None
    log.info(
        "calculet: Prometheus metrics on http://%s:%d/metrics",
        opts.metrics_host or "0.0.0.0",
        server.server_port,
    )
    return server
