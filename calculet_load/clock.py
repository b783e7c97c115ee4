"""Clocks: every time stamp in calculet-load is read through a `Clock`.

Durations come from `mono_ns()` only: integer nanoseconds from one monotonic clock.
`wall_ns()` places a record in calendar time and joins it with other hosts; it can step,
so it is never used for a duration. A `ClockAnchor` pairs the two once, and
`query_ntp_offset` records how far this host's wall clock is from its NTP reference.

`SystemClock` reads `time.monotonic_ns` and `time.time_ns`. On Linux, CPython reads both
`monotonic_ns` and `perf_counter_ns` from clock_gettime(CLOCK_MONOTONIC), so the two give
the same values at the same 1 ns resolution (tests/base/test_clock.py checks this). We
name `monotonic` because that is the property durations rely on. CLOCK_MONOTONIC is
shared by every process on a host (outside time namespaces), so the stamps of a client
and a server on one machine can be compared directly. NTP slews it but never steps it.
"""

import os
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Literal, Protocol, runtime_checkable

__all__ = [
    "Clock",
    "ClockAnchor",
    "FakeClock",
    "NtpSource",
    "NtpStatus",
    "SystemClock",
    "parse_chrony_tracking_csv",
    "parse_ntpq_rv",
    "parse_timedatectl_show",
    "query_ntp_offset",
]


@runtime_checkable
class Clock(Protocol):
    """A source of time stamps, in integer nanoseconds."""

    def mono_ns(self) -> int:
        """Monotonic time: for durations and ordering; arbitrary origin."""
        ...

    def wall_ns(self) -> int:
        """Wall time since the Unix epoch: for anchoring and joins, never durations."""
        ...


# TEST ONLY: shifts this process's wall clock (never its monotonic clock) by this many ns,
# so one machine can play hosts whose clocks disagree (tests/locust/test_netns.py). Read
# once at import; unset in any real run. libfaketime would also shift CLOCK_MONOTONIC and
# the threads of zmq and the sink, which is more than the test wants.
TEST_WALL_SHIFT_ENV = "CALCULET_TEST_WALL_SHIFT_NS"
_TEST_WALL_SHIFT_NS = int(os.environ.get(TEST_WALL_SHIFT_ENV, "0") or "0")


class SystemClock:
    """The real clocks: `time.monotonic_ns` and `time.time_ns` (plus the test-only shift
    of `CALCULET_TEST_WALL_SHIFT_NS`, 0 unless a test sets it)."""

    __slots__ = ()

    def mono_ns(self) -> int:
        return time.monotonic_ns()

    def wall_ns(self) -> int:
        return time.time_ns() + _TEST_WALL_SHIFT_NS


class FakeClock:
    """A clock for tests: time moves only when told to.

    `advance(ns)` moves both clocks forward together; `set_wall_ns` steps the wall clock
    alone, as an NTP step or an operator would, leaving the monotonic clock where it is.
    """

    __slots__ = ("_mono_ns", "_wall_ns")

    def __init__(self, mono_ns: int = 0, wall_ns: int = 1_700_000_000_000_000_000) -> None:
        self._mono_ns = mono_ns
        self._wall_ns = wall_ns

    def mono_ns(self) -> int:
        return self._mono_ns

    def wall_ns(self) -> int:
        return self._wall_ns

    def advance(self, ns: int) -> None:
        if ns < 0:
            raise ValueError(f"a monotonic clock cannot go back (advance by {ns} ns)")
        self._mono_ns += ns
        self._wall_ns += ns

    def set_wall_ns(self, wall_ns: int) -> None:
        self._wall_ns = wall_ns


def mono_at_wall(wall_ns: int, clock: Clock | None = None) -> int:
    """The monotonic instant at which `clock`'s wall clock (this process's by default)
    shows `wall_ns`: the one wall-to-monotonic conversion (waits are on the monotonic
    clock; an instant shared across processes is a wall instant)."""
    clock = clock or SystemClock()
    return clock.mono_ns() + (wall_ns - clock.wall_ns())


@dataclass(frozen=True, slots=True)
class ClockAnchor:
    """One monotonic reading paired with one wall reading, taken back to back.

    `mono_ns` is the midpoint of the two monotonic reads that bracketed the wall read, so
    the monotonic time at the wall read lies within `mono_ns ± uncertainty_ns`
    (`uncertainty_ns` is half the bracket, rounded up).
    """

    mono_ns: int
    wall_ns: int
    uncertainty_ns: int

    @classmethod
    def take(cls, clock: Clock, tries: int = 5) -> "ClockAnchor":
        """Bracket a wall read with two monotonic reads `tries` times; keep the tightest."""
        if tries < 1:
            raise ValueError(f"tries must be >= 1, got {tries}")
        best_gap = best_before = best_wall = -1
        for _ in range(tries):
            before = clock.mono_ns()
            wall = clock.wall_ns()
            gap = clock.mono_ns() - before
            if best_gap < 0 or gap < best_gap:
                best_gap, best_before, best_wall = gap, before, wall
                if gap == 0:
                    break
        half = best_gap // 2
        return cls(best_before + half, best_wall, best_gap - half)

    def wall_ns_at(self, mono_ns: int) -> int:
        """The wall time of a monotonic stamp, as if the wall clock had not stepped since."""
        return self.wall_ns + (mono_ns - self.mono_ns)


NtpSource = Literal["chrony", "ntpd", "timedatectl", "none"]


@dataclass(frozen=True, slots=True)
class NtpStatus:
    """How far this host's wall clock is from its NTP reference, as its daemon says.

    `offset_ns` is reference time minus local wall time (positive: the local clock is
    behind), so reference ≈ local `wall_ns` + `offset_ns`: the one convention of
    calculet_load.schema.clocks (convert with its `to_reference_ns`). It is None when no daemon
    reports one, or reports itself unsynchronised; never 0 for unknown.
    `synchronized` is None when unknown. `detail` says what was read or why nothing was.
    """

    source: NtpSource
    offset_ns: int | None
    synchronized: bool | None
    detail: str


def _decimal_to_ns(text: str, exponent: int) -> int:
    """`text` is a decimal number of units of 10**-exponent s; exact, no float rounding."""
    try:
        value = Decimal(text)
    except InvalidOperation:
        raise ValueError(f"not a number: {text!r}") from None
    if not value.is_finite():
        raise ValueError(f"not a finite number: {text!r}")
    return round(value.scaleb(exponent))


def parse_chrony_tracking_csv(text: str) -> NtpStatus:
    """Parse `chronyc -c tracking`.

    Fields (chrony client.c, process_cmd_tracking): reference ID, name, stratum, ref time,
    system time (s), last offset, RMS offset, frequency, residual frequency, skew, root
    delay, root dispersion, update interval, leap status. In CSV, "system time" is signed
    and positive means "slow of NTP time", which is our `offset_ns` sign.
    """
    line = next((ln for ln in text.splitlines() if ln.strip()), "")
    fields = line.split(",")
    if len(fields) < 14:
        raise ValueError(f"expected 14 CSV fields from chronyc tracking, got {line!r}")
    name, stratum, system_time, leap = fields[1], fields[2], fields[4], fields[13]
    synchronized = leap != "Not synchronised"
    # Unsynchronised, chronyd prints a system time of 0.000000000: unknown, not zero.
    offset_ns = _decimal_to_ns(system_time, 9) if synchronized else None
    detail = (
        f"chronyc tracking: reference {name or fields[0]} stratum {stratum}, "
        f"leap status {leap}, system time {system_time} s (positive = local clock behind)"
    )
    return NtpStatus("chrony", offset_ns, synchronized, detail)


def parse_ntpq_rv(text: str) -> NtpStatus:
    """Parse `ntpq -c rv` (ntpd or NTPsec) system variables.

    `offset` is in milliseconds, "offset of server relative to this host" (positive: the
    local clock is behind), our sign. `leap=11` is the alarm state: not synchronised.
    """
    variables: dict[str, str] = {}
    for item in text.replace("\n", ",").split(","):
        key, sep, value = item.strip().partition("=")
        if sep and key.isidentifier():
            variables.setdefault(key, value.strip().strip('"'))
    if "offset" not in variables:
        raise ValueError("no offset= in ntpq rv output")
    leap = variables.get("leap")
    synchronized = None if leap is None else leap != "11"
    offset_ns = None if synchronized is False else _decimal_to_ns(variables["offset"], 6)
    detail = (
        f"ntpq rv: leap={leap} stratum={variables.get('stratum')} "
        f"refid={variables.get('refid')} offset={variables['offset']} ms "
        "(positive = local clock behind)"
    )
    return NtpStatus("ntpd", offset_ns, synchronized, detail)


def parse_timedatectl_show(text: str) -> NtpStatus:
    """Parse `timedatectl show`: whether systemd thinks the clock is synchronised.

    timedatectl reports no offset, so `offset_ns` is always None.
    """
    properties: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            properties[key.strip()] = value.strip()
    flag = properties.get("NTPSynchronized")
    if flag not in ("yes", "no"):
        raise ValueError(f"NTPSynchronized is {flag!r}, expected yes or no")
    detail = f"timedatectl: NTPSynchronized={flag} NTP={properties.get('NTP')}; no offset known"
    return NtpStatus("timedatectl", None, flag == "yes", detail)


Runner = Callable[..., subprocess.CompletedProcess[str]]

_QUERIES: tuple[tuple[Sequence[str], Callable[[str], NtpStatus]], ...] = (
    (("chronyc", "-c", "tracking"), parse_chrony_tracking_csv),
    (("ntpq", "-c", "rv"), parse_ntpq_rv),
    (("timedatectl", "show"), parse_timedatectl_show),
)


def query_ntp_offset(run: Runner = subprocess.run, timeout_s: float = 2.0) -> NtpStatus:
    """Ask chrony, then ntpd, then timedatectl; the first that answers wins.

    Each command gets `timeout_s`. If none answers, the result has source "none", offset
    and synchronisation None, and a detail naming why each failed.
    """
    failures: list[str] = []
    for argv, parse in _QUERIES:
        command = argv[0]
        try:
            proc = run(list(argv), capture_output=True, text=True, timeout=timeout_s, check=False)
        except FileNotFoundError:
            failures.append(f"{command}: not installed")
            continue
        except subprocess.TimeoutExpired:
            failures.append(f"{command}: no answer within {timeout_s} s")
            continue
        except OSError as exc:
            failures.append(f"{command}: {exc}")
            continue
        if proc.returncode != 0:
            why = (proc.stderr or proc.stdout or "").strip().splitlines()
            failures.append(f"{command}: exit {proc.returncode}: {why[0] if why else ''}")
            continue
        try:
            return parse(proc.stdout)
        except ValueError as exc:
            failures.append(f"{command}: unreadable output: {exc}")
    return NtpStatus("none", None, None, "; ".join(failures))


def clock_provenance() -> dict[str, object]:
    """This host's NTP offset (as its daemon reports it) and a monotonic/wall anchor pair:
    what lines one host's records up with another's. Written into `client/index.json`."""
    ntp = query_ntp_offset()
    anchor = ClockAnchor.take(SystemClock())  # the test-only wall shift shows here too
    return {
        "ntp_offset_ns": ntp.offset_ns,
        "ntp_source": ntp.source,
        "ntp_synchronized": ntp.synchronized,
        "ntp_detail": ntp.detail,
        "clock_anchor": {
            "mono_ns": anchor.mono_ns,
            "wall_ns": anchor.wall_ns,
            "uncertainty_ns": anchor.uncertainty_ns,
        },
    }


def wall_iso(wall_ns: int | None) -> str | None:
    """A wall time in ns as ISO 8601 UTC to the millisecond (for artifacts people read;
    never for durations). None stays None."""
    if wall_ns is None:
        return None
    t = wall_ns / 1e9
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1000):03d}Z"
