"""One process's share of a matrix cell: the load shapes of spec §6 sent through a Session.

`accept` runs a cell as a list of steps, each step a list of shares (one per client
process). On one host the pipeline's own process takes the whole cell; in a distributed
run (`accept --workers N` or `--master`) each Locust worker takes its share
(calculet_load/locust/cells.py). Request k of a cell is a pure function of (cell seed,
k), so splitting a cell changes which process sends a request, never what it is:

  single, boundary  one process sends the cell's requests one after the other
  closed            the cell's concurrency is split over the processes (users each), and
                    its repetitions in proportion
  open              every process is one slot of the one global arrival schedule
                    (calculet_load.workload.arrivals: arrival k belongs to slot k mod D), which
                    starts at a wall time the master fixes a moment ahead
  burst             one step per round: each process fires its part of the burst at the
                    round's wall instant, with the burst id on every request

`OpenLoop` is the one open-loop dispatcher: every driver that sends on a schedule
(a cell here, a Locust worker's slot, a capacity window, a soak stage) runs its
arrivals through it. This module is Locust-free: the pipeline imports it without
Locust's monkey-patching.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import gevent
import gevent.event
import gevent.pool

from calculet_load.clock import mono_at_wall
from calculet_load.measure.outcome import Outcome
from calculet_load.measure.prompts import Prompt, WorkloadError
from calculet_load.measure.selfwatch import TIMER_SLACK_S, sleep_until
from calculet_load.measure.session import RequestSpec, Session
from calculet_load.workload.arrivals import RateClock, Schedule
from calculet_load.workload.calls import Caller, Labels, PromptSource
from calculet_load.workload.conversation import Sessions, SessionStart
from calculet_load.workload.matrix import Cell
from calculet_load.workload.mixes import Mix, MixChooser

T = TypeVar("T")
OPEN_LEAD_S = 0.2  # schedule time 0 this far ahead of the step's dispatch
BURST_LEAD_S = 0.1  # a burst's instant this far ahead: connections open, prompts built
BURST_GAP_S = 0.2  # pause between two rounds of a burst cell
LATE_AFTER_MS = 5.0  # an open-loop send this late after its intended time is flagged late


class FleetError(Exception):
    """The client processes cannot run a step; `infra`: the cause is on the client side
    (a worker lost or unreachable: exit 3), else the workload itself (exit 2)."""

    def __init__(self, message: str, *, infra: bool = True) -> None:
        super().__init__(message)
        self.infra = infra


# A closed-loop user's pause after a request the target never answered.
NO_ANSWER_CLASSES = ("connect_refused", "unreachable")
FAIL_PAUSE_FIRST_S = 0.05
FAIL_PAUSE_MAX_S = 1.0


class FailPause:
    """A closed-loop user's pause after a request the target never answered (a refused
    connect, no route, a connection closed before any byte): without it a user whose
    target is down sends again as fast as the client can fail (thousands of records a
    second), and the run's self-watch judges its own client saturated where the target's
    errors are the finding. It doubles from 50 ms up to 1 s while the target does not
    answer; any answer (an HTTP error included) ends it. Open loops keep their schedule."""

    def __init__(self) -> None:
        self.next_s = 0.0

    def after(self, out: Outcome) -> None:
        self.wait(out.error_class, out.unanswered)

    def wait(self, error_class: str | None, unanswered: bool) -> None:
        """Pause after a request that failed with `error_class` (`unanswered`: not a byte
        of an answer came), or end the pause after an answer."""
        if error_class in NO_ANSWER_CLASSES or (unanswered and error_class):
            self.next_s = min(max(self.next_s * 2, FAIL_PAUSE_FIRST_S), FAIL_PAUSE_MAX_S)
            gevent.sleep(self.next_s)
        else:
            self.next_s = 0.0


@dataclasses.dataclass(frozen=True)
class Share:
    """What one process sends of one step of a cell."""

    cell: Cell
    mix: Mix
    seed: int
    first_k: int = 0  # single, closed, burst: requests k in [first_k, first_k + count)
    count: int = 0  # open: the cell's arrivals in all slots together
    users: int = 1  # closed: concurrent users in this process
    slot: int = 0  # open: this process's slot of `slots`
    slots: int = 1
    start_wall_ns: int = 0  # open: schedule time 0; burst: the instant; set at dispatch
    burst_id: str | None = None

    def to_wire(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["cell"] = self.cell.model_dump(by_alias=True)
        data["mix"] = self.mix.model_dump(by_alias=True)
        return data

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> Share:
        return cls(
            **{
                **data,
                "cell": Cell.model_validate(data["cell"]),
                "mix": Mix.model_validate(data["mix"]),
            }
        )

    def indexes(self) -> range:
        """The request indexes this share sends (an open-loop share: all of the cell's)."""
        return range(self.first_k, self.first_k + self.count)


def _spread(total: int, parts: int) -> list[int]:
    """`total` split into `parts` whole numbers differing by at most one, larger first."""
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


Step = list[Share | None]  # one share per process, None for a process idle in the step


def split(cell: Cell, mix: Mix, reps: int, seed: int, processes: int) -> list[Step]:
    """The cell as steps run one after the other; each step has one share per process
    that takes part (indexed by process, `None` for a process idle in that step)."""
    if processes < 1:
        raise ValueError("a cell needs at least one process")
    base = Share(cell=cell, mix=mix, seed=seed)
    if cell.kind in ("single", "boundary"):
        # one request at a time: one process (the first) sends them all
        alone: Step = [None] * processes
        alone[0] = dataclasses.replace(base, count=reps)
        return [alone]
    if cell.kind == "open":
        slots: Step = [
            dataclasses.replace(base, count=reps, slot=i, slots=processes) for i in range(processes)
        ]
        return [slots]
    if cell.kind == "closed":
        users = _spread(cell.concurrency, processes)
        counts = [0] * processes
        for k in range(reps):  # repetitions in proportion to the users (round robin)
            counts[_owner(k, users)] += 1
        step: Step = []
        first = 0
        for u, n in zip(users, counts, strict=True):
            step.append(dataclasses.replace(base, first_k=first, count=n, users=u) if u else None)
            first += n
        return [step]
    # burst: one step per round, the round's requests spread over the processes
    steps = []
    for r in range(cell.rounds):
        first = r * cell.size
        step = []
        for n in _spread(cell.size, processes):
            step.append(dataclasses.replace(base, first_k=first, count=n) if n else None)
            first += n
        steps.append(step)
    return steps


def _owner(k: int, users: list[int]) -> int:
    """The process whose turn request k is, process i having users[i] of the users."""
    seat = k % sum(users)
    for i, u in enumerate(itertools.accumulate(users)):
        if seat < u:
            return i
    raise AssertionError("unreachable")


class Sender(Generic[T]):
    """Sends arrivals (a request, or a programmed user's task) into a bounded pool of
    greenlets; one that finds the pool full is recorded as dropped (`drop(item,
    reason)`), never silently lost."""

    def __init__(
        self,
        pool: gevent.pool.Pool,
        send: Callable[[T], object],
        drop: Callable[[T, str], object],
    ) -> None:
        self.pool = pool
        self.send = send
        self.drop = drop

    def fire(self, spec: T, why_full: str = "") -> bool:
        """Spawn the request, or record it dropped if the pool is full; True if sent."""
        if self.pool.full():
            self.drop(spec, f"in-flight cap {self.pool.size} full{why_full}")
            return False
        self.pool.spawn(self.send, spec)
        return True


@dataclasses.dataclass
class OpenLoopResult:
    """What an open loop dispatched: arrivals due (sent or dropped), the dropped ones,
    the sends later than `late_after_ms` after their intended time, the largest lag."""

    arrivals: int = 0
    dropped: int = 0
    late: int = 0
    max_lag_ms: float = 0.0


@dataclasses.dataclass
class OpenLoop(Generic[T]):
    """The one open-loop dispatcher: arrival k of `schedule`'s slot `slot` is due at
    `origin_ns + clock.time_of(unit)` (monotonic ns); it sleeps until each, builds the
    request with `spec(k, due_ns)` just before the instant and fires it through
    `sender`. It ends at the first of: the schedule exhausted, arrival index `count`
    reached, an arrival due at or after `end_ns`, `stopped()` true.

    With `wake` (an event set on a rate change or a stop), it waits on the event rather
    than sleeping, so a change re-times the arrival it waits for, and a rate of 0 waits
    for the next change instead of ending the loop."""

    schedule: Schedule
    clock: RateClock
    origin_ns: int
    sender: Sender[T]
    spec: Callable[[int, int], T]
    slot: int = 0
    count: int | None = None
    end_ns: int | None = None
    stopped: Callable[[], bool] = lambda: False
    wake: gevent.event.Event | None = None
    late_after_ms: float = LATE_AFTER_MS
    why_full: str = ""  # appended to the drop reason
    # hand each arrival over a timer's slack before it is due instead of waiting for the
    # instant: the sender's I/O engine sends at the intended time (measure.io_engines)
    early: bool = False
    result: OpenLoopResult = dataclasses.field(default_factory=OpenLoopResult)
    _halted: bool = dataclasses.field(default=False, init=False)

    def done(self) -> bool:
        return self._halted or self.stopped()

    def run(self) -> OpenLoopResult:
        """Dispatch until one of the ends (in this greenlet); the requests it spawned
        may still be in flight: join `sender.pool` after."""
        res = self.result
        while not self.done():
            nxt = self.schedule.next_for(self.slot)
            if nxt is None:
                break
            k, unit = nxt
            if self.count is not None and k >= self.count:
                break
            due = self._wait_for(unit)
            if due is None:
                break
            spec = self.spec(k, due)
            if not self.early:
                sleep_until(due)
            if self.done():  # stopped while waiting
                break
            lag_ms = max(time.monotonic_ns() - due, 0) / 1e6
            res.max_lag_ms = max(res.max_lag_ms, lag_ms)
            res.late += lag_ms > self.late_after_ms
            res.arrivals += 1
            if not self.sender.fire(spec, self.why_full):
                res.dropped += 1
        return res

    def _wait_for(self, unit: float) -> int | None:
        """Wait until the arrival at unit time `unit` is a timer's slack away; its due
        instant (monotonic ns), or None if the loop ends first."""
        while not self.done():
            t = self.clock.time_of(unit)
            if t is None:  # the rate is 0 from here on
                if self.wake is None:
                    return None
                self.wake.clear()
                self.wake.wait(1.0)
                continue
            due = self.origin_ns + t
            if self.end_ns is not None and due >= self.end_ns:
                return None
            remaining = (due - time.monotonic_ns()) / 1e9
            if self.wake is not None and remaining > TIMER_SLACK_S:
                self.wake.clear()  # a rate change re-times this arrival
                self.wake.wait(remaining - TIMER_SLACK_S)
                continue
            return due
        return None

    def stop(self) -> None:
        """Stop at the next arrival (at once if waiting on `wake`)."""
        self._halted = True
        if self.wake is not None:
            self.wake.set()


# an arrival of a cell: a request, or the session a conversation entry starts
Arrival = RequestSpec | SessionStart


class CellRunner:
    """Sends shares through one Session; prompts come from `prompt(tokens, sample)`, and
    a conversation entry's (chat) from `prompts(protocol, tokens, sample)`."""

    def __init__(
        self,
        session: Session,
        prompt: Callable[[int, int], Prompt],
        prompts: PromptSource | None = None,
    ) -> None:
        self.session = session
        self.prompt = prompt
        self.sessions = Sessions(Caller(session, prompts)) if prompts is not None else None

    def _sessions(self) -> Sessions:
        if self.sessions is None:
            raise WorkloadError("a conversation entry needs the chat prompts of the target")
        return self.sessions

    def prepare(self, share: Share) -> None:
        """Build every prompt the share will use before its first request: a /tokenize
        round trip inside the schedule would make the arrivals after it late."""
        chooser = share.mix.chooser(share.seed)
        if share.cell.kind == "open":
            for entry in share.mix.entries:
                if entry.kind == "conversation":
                    self._sessions().prepare(entry)
                    continue
                for sample in range(min(entry.samples, share.count)):
                    self.prompt(entry.prompt_tokens, sample)
            return
        for k in share.indexes():
            entry, sample = chooser.entry_for(k)
            if entry.kind == "conversation":
                self._sessions().prepare(entry)
            else:
                self.prompt(entry.prompt_tokens, sample)

    def send(self, item: Arrival) -> Outcome | None:
        """Send an arrival: its request, or its session (the last turn's outcome is not
        kept: None)."""
        if isinstance(item, SessionStart):
            self._sessions().run(item)
            return None
        return self.session.send(item)[1]

    def dropped(self, item: Arrival, reason: str) -> None:
        if isinstance(item, SessionStart):
            item = self._sessions().dropped_spec(item)
        self.session.record_dropped(item, reason)

    def run(self, share: Share) -> int:
        """Send the share (in this greenlet; blocks until its requests have ended).
        Call `prepare(share)` first: building a prompt inside the schedule is late."""
        chooser = share.mix.chooser(share.seed)
        kind = share.cell.kind
        if kind in ("single", "boundary"):
            for k in share.indexes():
                self.send(self.spec(share, chooser, k, concurrency=1, arrival="single"))
            return share.count
        if kind == "closed":
            return self._closed(share, chooser)
        if kind == "open":
            return self._open(share, chooser)
        return self._burst(share, chooser)

    def spec(self, share: Share, chooser: MixChooser, k: int, **kw: Any) -> Arrival:
        cell = share.cell
        entry, sample = chooser.entry_for(k)
        if entry.kind == "conversation":
            return SessionStart(k, entry, Labels(**kw), cell.name)
        return RequestSpec(
            prompt=self.prompt(entry.prompt_tokens, sample),
            max_tokens=entry.max_tokens,
            stream=cell.stream and entry.stream,
            temperature=cell.temperature,
            seed=share.seed if cell.temperature > 0 else None,
            cell=cell.name,
            **kw,
        )

    def _closed(self, share: Share, chooser: MixChooser) -> int:
        keys = iter(share.indexes())  # shared: each user takes the next request when free
        label = share.cell.concurrency

        def user() -> None:
            pause = FailPause()
            for k in keys:
                spec = self.spec(share, chooser, k, concurrency=label, arrival="closed")
                out = self.send(spec)
                if out is not None:
                    pause.after(out)

        gevent.joinall([gevent.spawn(user) for _ in range(share.users)])
        return share.count

    def _open(self, share: Share, chooser: MixChooser) -> int:
        cell = share.cell
        clock = RateClock(cell.rate, share.slots)
        pool = gevent.pool.Pool(max(cell.max_in_flight // share.slots, 1))
        loop = OpenLoop(
            schedule=Schedule(cell.arrival, share.seed, clock, burstiness=cell.burstiness),
            clock=clock,
            origin_ns=mono_at_wall(share.start_wall_ns),
            sender=Sender(pool, self.send, self.dropped),
            spec=lambda k, due: self.spec(
                share,
                chooser,
                k,
                arrival=cell.arrival,
                intended_start_ns=due,
                late_after_ms=LATE_AFTER_MS,
            ),
            slot=share.slot,
            count=share.count,
        )
        sent = loop.run().arrivals
        pool.join()
        return sent

    def _burst(self, share: Share, chooser: MixChooser) -> int:
        cell = share.cell
        self.session.pool.prewarm(share.count)
        due = mono_at_wall(share.start_wall_ns)
        specs = [
            self.spec(
                share, chooser, k, arrival="burst", burst_id=share.burst_id,
                intended_start_ns=due, concurrency=cell.size,
            )
            for k in share.indexes()
        ]  # fmt: skip
        sleep_until(due)
        gevent.joinall([gevent.spawn(self.send, s) for s in specs])
        return len(specs)
