"""calculet-load's Locust options, declared once: each one's flags, default, help, whether
the web UI's start form shows it, and for a number its kind and allowed range.

The same declaration registers the options with Locust's parser, checks what the command
line, `locust.conf`, the environment and the web UI's form give (`problems`, `convert`:
one line naming the option and its range, never a traceback), and checks the values of
the REST endpoints (`number`). A number is registered as text, so argparse never refuses
it with its own two-line usage error: it is converted and checked here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from calculet_load.locust.accuracy import BUDGET_MS
from calculet_load.measure.io_engines import DEFAULT_IO_ENGINE, IO_ENGINES
from calculet_load.measure.prompts import MAX_CONTEXT
from calculet_load.ranges import Number
from calculet_load.schema.access import add_access_arguments
from calculet_load.schema.profiles import PROFILE_NAMES

ARRIVALS = ("closed", "poisson", "constant", "gamma", "replay", "burst")
PROTOCOLS = ("llama", "openai-chat", "openai-completions")
MAX_OUTPUT_TOKENS = 1 << 20  # above any model's context: a larger max_tokens is a typo
DAY_S = 86_400.0


@dataclasses.dataclass(frozen=True)
class Option:
    flags: tuple[str, ...]
    kw: dict[str, Any]
    number: Number | None = None
    ui: bool = True  # in the web UI's start form

    @property
    def dest(self) -> str:
        return str(self.kw.get("dest") or self.flags[0].lstrip("-").replace("-", "_"))

    @property
    def flag(self) -> str:
        return self.flags[0]


def _num(kind: type[int] | type[float], lo: float, hi: float, open_: bool = False) -> Number:
    return Number(kind, lo, hi, open_)


OPTIONS: tuple[Option, ...] = (
    Option(("--protocol",), dict(choices=PROTOCOLS, default="llama", help="target protocol")),
    Option(("--model",), dict(default="", help="model name sent to OpenAI-style targets")),
    Option(("--target-profile",), dict(
        choices=PROFILE_NAMES, default=None,
        help="what kind of server the target is: how prompts are sized, which endpoints it "
        "has (default: detected from the target, docs/targets.md)")),
    Option(("--tokenizer",), dict(
        default="", help="a local tokenizer.json that sizes the prompts (and counts the "
        "events that carry no count from the server)")),
    Option(("--prompt-reuse",), dict(
        action="store_true", default=False,
        help="send each prompt as built (cache studies); default: unique per request")),
    Option(("--arrival",), dict(
        choices=ARRIVALS, default=None,
        help="closed (the default): each user waits for its response; poisson/constant/"
        "gamma/replay: open loop at --rate, independent of responses; burst: --burst-size "
        "at once (default: a user class's `arrival`, else closed)")),
    Option(("--rate",), dict(
        default=None, help="open loop: arrivals per second, all workers (default: a user "
        "class's `rate`, else 1)"), _num(float, 0, 1e6)),
    Option(("--burstiness",), dict(default=1.0, help="gamma: shape k (CV = 1/sqrt(k))"),
           _num(float, 0, 1e6, True)),
    Option(("--replay-file",), dict(default="", help="replay: arrival timestamps (s), one a line")),
    Option(("--mix",), dict(default="", help="workload mix: a file or a name in configs/mixes/")),
    Option(("--prompt-tokens",), dict(default=128, help="prompt length (without --mix)"),
           _num(int, 1, MAX_CONTEXT - 1)),
    Option(("--max-tokens",), dict(default=32, help="output tokens (without --mix)"),
           _num(int, 1, MAX_OUTPUT_TOKENS)),
    Option(("--max-in-flight",), dict(default=256, help="open loop: in-flight cap per process"),
           _num(int, 1, 100_000)),
    Option(("--late-ms",), dict(default=5.0, help="an arrival sent later than this is late"),
           _num(float, 0, 3_600_000)),
    Option(("--accuracy-ms",), dict(
        default=BUDGET_MS, env_var="LOCUST_ACCURACY_MS",
        help="the run's timing budget: a cell whose read wait or send lag P99 passes it is "
        "named and the run exits 3"), _num(float, 0, 3_600_000, True)),
    Option(("--io-engine",), dict(
        choices=tuple(IO_ENGINES), default=DEFAULT_IO_ENGINE, env_var="LOCUST_IO_ENGINE",
        help="where the timing-critical socket I/O runs: thread (the default: one "
        "asyncio/uvloop thread per worker process, sending each open-loop arrival at its "
        "intended time) or gevent (the users' greenlets); docs/measurement.md")),
    Option(("--burst-size",), dict(default=8, help="burst: requests fired at one instant"),
           _num(int, 1, 100_000)),
    Option(("--burst-every",), dict(default=0.0, help="burst: period in s (0: one burst)"),
           _num(float, 0, DAY_S)),
    Option(("--burst-lead",), dict(default=1.0, help="burst: announce this many s ahead"),
           _num(float, 0, 3600)),
    Option(("--seed",), dict(default=0, help="seed of the schedule and the mix choices"),
           _num(int, 0, 2**63 - 1)),
    Option(("--run-id",), dict(default="", help="run id (default: the manifest's, else made)")),
    Option(("--run-dir",), dict(default="", help="run folder, path or URI (default: runs/<id>)")),
    Option(("--manifest",), dict(default="", help="run manifest YAML (provenance of records)")),
    Option(("--request-timeout",), dict(default=900.0, help="total timeout per request, s"),
           _num(float, 0, DAY_S, True)),
    Option(("--start-delay",), dict(default=2.0, help="open loop: schedule starts after, s"),
           _num(float, 0, 3600)),
    Option(("--no-stream",), dict(action="store_true", default=False,
                                  help="ask for whole responses")),
    Option(("--stages",), dict(
        default="", help="with locustfiles/stages.py: DURATION_S@RATE[@BURST_SIZE/EVERY_S],... "
        "or a YAML file"), ui=False),
    Option(("--metrics-port",), dict(default=0, help="serve Prometheus /metrics (0: off)"),
           _num(int, 0, 65535), ui=False),
    Option(("--metrics-host",), dict(default="", help="--metrics-port's address (default: all)"),
           ui=False),
    Option(("--scrape-interval",), dict(
        default=5.0, help="master: sample the target's /metrics and process into server/ "
        "every N s (0: off)"), _num(float, 0, 3600), ui=False),
    Option(("--server-metrics-url",), dict(default="", help="default: TARGET/metrics"), ui=False),
    Option(("--no-server-traces",), dict(
        action="store_true", default=False,
        help="do not fetch the target's /traces/{kind} into server/ when a run stops"), ui=False),
    Option(("--trace-timeout",), dict(
        default=60.0, help="at stop: give up fetching the target's traces after N s"),
        _num(float, 0, 3600, True), ui=False),
    Option(("--clock-sync-every",), dict(
        default=30.0, help="master: measure each worker's clock offset again every N s "
        "(0: at connect only)"), _num(float, 0, DAY_S), ui=False),
    Option(("--rtt-samples",), dict(
        default=8, help="connect and /health round trips to the target per round, per "
        "worker (0: off)"), _num(int, 0, 1000), ui=False),
    Option(("--rtt-every",), dict(default=60.0, help="a round every N s (0: once)"),
           _num(float, 0, DAY_S), ui=False),
    Option(("--server-pid",), dict(
        default=0, help="target process to sample (0: by the target's port on this host; "
        "-1: off)"), _num(int, -1, 2**22), ui=False),
)  # fmt: skip
BY_DEST = {o.dest: o for o in OPTIONS}


def register(add: Callable[..., Any], ui_options: set[str]) -> None:
    """Every option with Locust's `add_argument` (its `include_in_web_ui` keyword); the
    access options (secrets: not in the web UI) too. Numbers as text: `problems` checks."""
    for o in OPTIONS:
        kw = dict(o.kw)
        if o.number is not None:
            kw["type"] = str
        add(*o.flags, include_in_web_ui=o.ui, **kw)
        if o.ui:
            ui_options.add(o.dest)
    add_access_arguments(lambda *flags, **kw: add(*flags, include_in_web_ui=False, **kw))


def number(dest: str, raw: Any, name: str | None = None) -> tuple[int | float | None, str | None]:
    """A numeric option's value from `raw` (text or a number), or the problem naming it
    `name` (a REST body's field; default: the option's flag)."""
    o = BY_DEST[dest]
    assert o.number is not None, dest
    return o.number.parse(name or o.flag, raw)


def convert(opts: Any) -> list[str]:
    """Every numeric option of `opts` made its number (in place); a problem each for those
    that are not one in range. An option left out (None) stays None."""
    problems = []
    for o in OPTIONS:
        raw = getattr(opts, o.dest, None)
        if o.number is None or raw is None:
            continue
        value, problem = o.number.parse(o.flag, raw)
        if problem is not None:
            problems.append(problem)
        else:
            setattr(opts, o.dest, value)
    return problems


def form_value(dest: str, current: Any, raw: str) -> tuple[Any, str | None]:
    """A web UI form field as its option's value (as Locust's /swarm converts it), or the
    problem."""
    o = BY_DEST.get(dest)
    if o is not None and o.number is not None:
        return o.number.parse(o.flag, raw)
    if isinstance(current, bool):
        return raw == "true", None
    choices = o.kw.get("choices") if o is not None else None
    if choices and raw not in choices:
        flag = o.flag if o is not None else dest
        return None, f"{flag} must be one of {', '.join(choices)}, got {raw!r}"
    return raw, None
