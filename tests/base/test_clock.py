"""Tests for calculet_load.clock. Sample outputs are written as the tools print them."""

import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from calculet_load.clock import (
    Clock,
    ClockAnchor,
    FakeClock,
    NtpStatus,
    SystemClock,
    parse_chrony_tracking_csv,
    parse_ntpq_rv,
    parse_timedatectl_show,
    query_ntp_offset,
)

# --- clocks ------------------------------------------------------------------------------


def test_system_and_fake_clocks_satisfy_the_protocol() -> None:
    clocks: list[Clock] = [SystemClock(), FakeClock()]
    assert all(isinstance(c, Clock) for c in clocks)
    assert all(isinstance(c.mono_ns(), int) and isinstance(c.wall_ns(), int) for c in clocks)


def test_system_clock_monotonic_reads_never_go_back() -> None:
    clock = SystemClock()
    reads = [clock.mono_ns() for _ in range(1000)]
    assert reads == sorted(reads)


@pytest.mark.skipif(sys.platform != "linux", reason="the documented equivalence is Linux's")
def test_monotonic_and_perf_counter_are_the_same_clock_on_linux() -> None:
    mono, perf = time.get_clock_info("monotonic"), time.get_clock_info("perf_counter")
    assert mono.implementation == perf.implementation == "clock_gettime(CLOCK_MONOTONIC)"
    assert mono.resolution == perf.resolution == 1e-09
    # Same clock, so readings interleave in order.
    a, b, c = time.monotonic_ns(), time.perf_counter_ns(), time.monotonic_ns()
    assert a <= b <= c


def test_fake_clock_advances_both_clocks_and_steps_the_wall_alone() -> None:
    clock = FakeClock(mono_ns=5, wall_ns=1_000)
    clock.advance(10)
    assert (clock.mono_ns(), clock.wall_ns()) == (15, 1_010)
    clock.set_wall_ns(50)  # an NTP step backwards
    assert (clock.mono_ns(), clock.wall_ns()) == (15, 50)
    with pytest.raises(ValueError, match="cannot go back"):
        clock.advance(-1)
    assert clock.mono_ns() == 15


# --- ClockAnchor -------------------------------------------------------------------------


class ScriptedClock:
    """Returns the given monotonic and wall readings in order."""

    def __init__(self, mono: Sequence[int], wall: Sequence[int]) -> None:
        self._mono: Iterator[int] = iter(mono)
        self._wall: Iterator[int] = iter(wall)

    def mono_ns(self) -> int:
        return next(self._mono)

    def wall_ns(self) -> int:
        return next(self._wall)


def test_anchor_keeps_the_tightest_bracket_and_its_midpoint() -> None:
    # Brackets: [100, 190] gap 90; [200, 211] gap 11; [300, 340] gap 40.
    clock = ScriptedClock([100, 190, 200, 211, 300, 340], [7_000, 7_100, 7_200])
    anchor = ClockAnchor.take(clock, tries=3)
    # Midpoint 200 + 11 // 2 = 205; the true instant is in [200, 211], so within 205 ± 6.
    assert anchor == ClockAnchor(mono_ns=205, wall_ns=7_100, uncertainty_ns=6)


def test_anchor_stops_early_on_a_zero_gap() -> None:
    clock = ScriptedClock([10, 10], [99])  # a third read would raise StopIteration
    assert ClockAnchor.take(clock, tries=5) == ClockAnchor(10, 99, 0)


def test_anchor_from_a_fake_clock_and_conversion_to_wall_time() -> None:
    clock = FakeClock(mono_ns=1_000, wall_ns=1_700_000_000_000_000_000)
    anchor = ClockAnchor.take(clock)
    assert anchor == ClockAnchor(1_000, 1_700_000_000_000_000_000, 0)
    # A stamp 2.5 ms later on the monotonic clock is 2.5 ms later on the wall.
    assert anchor.wall_ns_at(2_501_000) == 1_700_000_000_002_500_000


def test_anchor_from_the_system_clock_is_plausible() -> None:
    anchor = ClockAnchor.take(SystemClock())
    assert anchor.uncertainty_ns >= 0
    assert anchor.mono_ns <= time.monotonic_ns()


def test_anchor_needs_at_least_one_try() -> None:
    with pytest.raises(ValueError, match="tries"):
        ClockAnchor.take(FakeClock(), tries=0)


# --- NTP output parsing ------------------------------------------------------------------

# `chronyc -c tracking` on a synchronised host: system time -0.000012345 s, i.e. 12.345 us
# "fast of NTP time" (the human form prints the absolute value and the word).
CHRONY_SYNCED = (
    "A9FEA97B,169.254.169.123,4,1704967211.422129830,-0.000012345,-0.000002345,"
    "0.000010123,-3.456,-0.001,0.012,0.000345678,0.000123456,64.2,Normal\n"
)
CHRONY_SLOW = (
    "C0A80101,192.168.1.1,2,1704967211.422129830,0.002500000,0.001937512,"
    "0.000812440,12.103,0.004,0.210,0.012345678,0.001234567,128.5,Insert second\n"
)
# chronyd just started, no source yet: every number is zero, meaning "unknown".
CHRONY_UNSYNCED = (
    "00000000,,0,0.000000000,0.000000000,0.000000000,0.000000000,0.000,0.000,0.000,"
    "1.000000000,1.000000000,0.0,Not synchronised\n"
)

NTPD_SYNCED = """\
associd=0 status=0615 leap_none, sync_ntp, 1 event, clock_sync,
version="ntpd 4.2.8p15@1.3728-o Wed Feb 16 17:13:02 UTC 2022 (1)",
processor="x86_64", system="Linux/5.15.0-91-generic", leap=00, stratum=3,
precision=-24, rootdelay=18.934, rootdisp=31.554, refid=203.0.113.10,
reftime=e94a3c1b.6c1f7a3e  Thu, Jan 11 2024 10:00:11.422,
clock=e94a3d4a.a3b2d6c4  Thu, Jan 11 2024 10:05:14.639, peer=61463, tc=10,
mintc=3, offset=-0.127953, frequency=-12.345, sys_jitter=0.123456,
clk_jitter=0.089, clk_wander=0.004, tai=37, leapsec=201701010000,
expire=202406280000
"""
NTPSEC_SYNCED = """\
associd=0 status=0618 leap_none, sync_ntp, 1 event, no_sys_peer,
version="ntpd ntpsec-1.2.2 2023-01-16T00:00:00Z",
processor="x86_64", system="Linux/6.1.0-17-amd64", leap=00, stratum=2,
precision=-25, rootdelay=7.236, rootdisp=12.987, refid=192.0.2.17,
reftime=e94a3c1b.6c1f7a3e 2024-01-11T10:00:11.422Z,
clock=e94a3d4a.a3b2d6c4 2024-01-11T10:05:14.639Z, peer=48259, tc=10,
mintc=0, offset=+0.412381, frequency=-3.118, sys_jitter=0.285413,
clk_jitter=0.197, clk_wander=0.010
"""
NTPD_UNSYNCED = """\
associd=0 status=c016 leap_alarm, sync_unspec, 1 event, restart,
version="ntpd 4.2.8p15@1.3728-o Wed Feb 16 17:13:02 UTC 2022 (1)",
processor="x86_64", system="Linux/5.15.0-91-generic", leap=11, stratum=16,
precision=-24, rootdelay=0.000, rootdisp=0.450, refid=INIT,
reftime=00000000.00000000  Mon, Jan  1 1900  0:00:00.000,
clock=e94a3d4a.a3b2d6c4  Thu, Jan 11 2024 10:05:14.639, peer=0, tc=3,
mintc=3, offset=0.000000, frequency=0.000, sys_jitter=0.000000,
clk_jitter=0.000, clk_wander=0.000
"""

TIMEDATECTL_SYNCED = """\
Timezone=Etc/UTC
LocalRTC=no
CanNTP=yes
NTP=yes
NTPSynchronized=yes
TimeUSec=Thu 2024-01-11 10:05:14 UTC
RTCTimeUSec=Thu 2024-01-11 10:05:14 UTC
"""
TIMEDATECTL_UNSYNCED = TIMEDATECTL_SYNCED.replace("NTPSynchronized=yes", "NTPSynchronized=no")


@pytest.mark.parametrize(
    ("text", "offset_ns", "synchronized"),
    [
        (CHRONY_SYNCED, -12_345, True),  # local clock 12.345 us ahead of NTP time
        (CHRONY_SLOW, 2_500_000, True),  # 2.5 ms behind; a leap second pending still syncs
        (CHRONY_UNSYNCED, None, False),
    ],
)
def test_parse_chrony_tracking(text: str, offset_ns: int | None, synchronized: bool) -> None:
    status = parse_chrony_tracking_csv(text)
    assert (status.source, status.offset_ns, status.synchronized) == (
        "chrony",
        offset_ns,
        synchronized,
    )
    assert "leap status" in status.detail


def test_parse_chrony_tolerates_fields_added_at_the_end() -> None:
    assert parse_chrony_tracking_csv(CHRONY_SYNCED.strip() + ",42\n").offset_ns == -12_345


@pytest.mark.parametrize(
    "text",
    ["", "506 Cannot talk to daemon\n", CHRONY_SYNCED.replace("-0.000012345", "nan"),
     CHRONY_SYNCED.replace("-0.000012345", "fast")],
)  # fmt: skip
def test_parse_chrony_refuses_what_it_cannot_read(text: str) -> None:
    with pytest.raises(ValueError):
        parse_chrony_tracking_csv(text)


@pytest.mark.parametrize(
    ("text", "offset_ns", "synchronized"),
    [
        (NTPD_SYNCED, -127_953, True),  # -0.127953 ms, exactly
        (NTPSEC_SYNCED, 412_381, True),
        (NTPD_UNSYNCED, None, False),  # offset=0.000000 is "unknown" here, not zero
    ],
)
def test_parse_ntpq_rv(text: str, offset_ns: int | None, synchronized: bool) -> None:
    status = parse_ntpq_rv(text)
    assert (status.source, status.offset_ns, status.synchronized) == (
        "ntpd",
        offset_ns,
        synchronized,
    )


def test_parse_ntpq_rv_without_leap_reports_sync_as_unknown() -> None:
    status = parse_ntpq_rv("stratum=2, offset=1.5\n")
    assert (status.offset_ns, status.synchronized) == (1_500_000, None)


@pytest.mark.parametrize("text", ["", "ntpq: read: Connection refused\n", "clk_offset=1.0\n"])
def test_parse_ntpq_rv_refuses_output_without_offset(text: str) -> None:
    with pytest.raises(ValueError, match="offset"):
        parse_ntpq_rv(text)


def test_parse_timedatectl_show() -> None:
    synced = parse_timedatectl_show(TIMEDATECTL_SYNCED)
    assert (synced.source, synced.offset_ns, synced.synchronized) == ("timedatectl", None, True)
    assert parse_timedatectl_show(TIMEDATECTL_UNSYNCED).synchronized is False
    with pytest.raises(ValueError, match="NTPSynchronized"):
        parse_timedatectl_show("Timezone=Etc/UTC\n")


# --- query_ntp_offset --------------------------------------------------------------------

Answer = str | BaseException | tuple[int, str, str]


class FakeRun:
    """Stands in for subprocess.run: answers by command name, records the calls."""

    def __init__(self, answers: dict[str, Answer]) -> None:
        self.answers = answers
        self.calls: list[tuple[list[str], dict[str, Any]]] = []

    def __call__(self, argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        self.calls.append((argv, kwargs))
        answer = self.answers.get(argv[0], FileNotFoundError(2, "No such file", argv[0]))
        if isinstance(answer, BaseException):
            raise answer
        rc, out, err = (0, answer, "") if isinstance(answer, str) else answer
        return subprocess.CompletedProcess(argv, rc, out, err)


def test_query_prefers_chrony_and_passes_a_timeout() -> None:
    run = FakeRun({"chronyc": CHRONY_SYNCED, "ntpq": NTPD_SYNCED})
    status = query_ntp_offset(run, timeout_s=0.5)
    assert (status.source, status.offset_ns) == ("chrony", -12_345)
    assert run.calls == [
        (
            ["chronyc", "-c", "tracking"],
            {"capture_output": True, "text": True, "timeout": 0.5, "check": False},
        )
    ]


def test_query_reports_an_unsynchronised_chrony_rather_than_asking_others() -> None:
    run = FakeRun({"chronyc": CHRONY_UNSYNCED, "ntpq": NTPD_SYNCED})
    assert query_ntp_offset(run) == parse_chrony_tracking_csv(CHRONY_UNSYNCED)
    assert len(run.calls) == 1


def test_query_falls_back_to_ntpd_then_timedatectl() -> None:
    run = FakeRun({"chronyc": (1, "", "506 Cannot talk to daemon\n"), "ntpq": NTPD_SYNCED})
    assert query_ntp_offset(run).source == "ntpd"
    run = FakeRun(
        {
            "chronyc": subprocess.TimeoutExpired(["chronyc"], 2.0),
            "ntpq": "ntpq: read: Connection refused\n",
            "timedatectl": TIMEDATECTL_SYNCED,
        }
    )
    status = query_ntp_offset(run)
    assert (status.source, status.offset_ns, status.synchronized) == ("timedatectl", None, True)
    assert [argv[0] for argv, _ in run.calls] == ["chronyc", "ntpq", "timedatectl"]


def test_query_with_nothing_available_says_none_and_why() -> None:
    run = FakeRun(
        {
            "ntpq": PermissionError(13, "Permission denied"),
            "timedatectl": (
                1,
                "",
                "System has not been booted with systemd as init system (PID 1). Can't operate.\n"
                "Failed to connect to bus: Host is down\n",
            ),
        }
    )
    status = query_ntp_offset(run)
    assert status == NtpStatus(
        "none",
        None,
        None,
        "chronyc: not installed; ntpq: [Errno 13] Permission denied; timedatectl: exit 1: "
        "System has not been booted with systemd as init system (PID 1). Can't operate.",
    )


def test_query_on_this_host_never_reports_zero_for_unknown() -> None:
    status = query_ntp_offset(timeout_s=2.0)
    if status.source in ("none", "timedatectl"):
        assert status.offset_ns is None
    if status.source == "none":
        assert status.synchronized is None
