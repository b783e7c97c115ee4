"""A soak's load: closed loop or open loop at a fraction of the target rate, a mix or
one shape, and the periodic bursts on the stage's grid; prompts built before it starts."""

from __future__ import annotations

import itertools
import time
from typing import Any

import gevent
import gevent.pool

from calculet_drivers.soak.sampling import SoakSampling
from calculet_load.measure.session import RequestSpec
from calculet_load.workload.arrivals import RateClock, Schedule
from calculet_load.workload.dispatch import LATE_AFTER_MS, OpenLoop, Sender
from calculet_load.workload.mixes import single

__all__ = ["SoakLoad"]


class SoakLoad(SoakSampling):
    """The load and the bursts, sent until the stage's planned end (`t_end`)."""

    def _spec(self, k: int, chooser: Any, **kw: Any) -> RequestSpec:
        entry, sample = chooser.entry_for(k)
        return RequestSpec(
            prompt=self.client.prompt(entry.prompt_tokens, sample),
            max_tokens=entry.max_tokens,
            stream=entry.stream,
            temperature=entry.temperature,
            cell=f"soak:{self.stage.name}:{entry.name}",
            **kw,
        )

    def _prebuild_prompts(self) -> int:
        """Build (tokenize) every prompt the load and the bursts will use before the load
        starts: built on first use, each would hold its arrival back by a tokenizer round
        trip (a send lag of 100+ ms in the first seconds of every attempt)."""
        ld, b = self.stage.load, self.stage.bursts
        mixes = [self.mix or single(ld.prompt_tokens, ld.max_tokens, stream=ld.stream)]
        if b is not None:
            mixes.append(single(b.prompt_tokens, b.max_tokens))
        for mix in mixes:
            for entry in mix.entries:
                for sample in range(entry.samples):
                    self.client.prompt(entry.prompt_tokens, sample)
        return len(self.client.prompts)

    def _seed(self) -> int:
        """The arrival seed of this attempt (a resumed attempt draws new arrivals)."""
        assert self.state is not None
        return int(self.opts["seed"]) + 1_000_003 * (len(self.state["attempts"]) - 1)

    def _load(self) -> None:
        ld = self.stage.load
        mix = self.mix or single(ld.prompt_tokens, ld.max_tokens, stream=ld.stream)
        chooser = mix.chooser(self._seed())
        if ld.kind == "closed":
            counter = itertools.count()

            def user() -> None:
                while time.monotonic() < self.t_end:
                    spec = self._spec(
                        next(counter), chooser, concurrency=ld.concurrency, arrival="closed"
                    )
                    self.session.send(spec)

            users = [self.senders.spawn(user) for _ in range(ld.concurrency)]
            gevent.joinall(users)
            return
        rate = self.rate_target * ld.rate_fraction / self.scale
        clock = RateClock(rate, 1)
        pool = self.open_pool = gevent.pool.Pool(ld.max_in_flight)
        OpenLoop(
            schedule=Schedule(ld.arrival, self._seed(), clock),
            clock=clock,
            origin_ns=time.monotonic_ns() + 200_000_000,
            sender=Sender(pool, self.session.send, self.session.record_dropped),
            spec=lambda k, due: self._spec(
                k, chooser, arrival=ld.arrival, intended_start_ns=due, late_after_ms=LATE_AFTER_MS
            ),
            end_ns=int(self.t_end * 1e9),
            stopped=lambda: self.terminating is not None,
        ).run()
        self._drain(pool)

    def _drain(self, pool: gevent.pool.Pool) -> None:
        """Wait for the requests in flight; what is still running after the hang limit
        is cut and counted as a hang (after SIGTERM: cut, not a hang)."""
        limit = self.stage.pass_.max_request_s * self.scale + 5.0
        pool.join(timeout=limit)
        left = len(pool)
        if left and self.terminating is None:
            self.notes.append(
                f"{self.worker}: {left} request(s) still in flight {limit:.1f} s after the end"
            )
            self.plan["hung_at_end"] = int(self.plan.get("hung_at_end", 0)) + left
        if left:
            pool.kill(block=True, timeout=10)

    def _bursts(self) -> None:
        """Bursts on the stage's grid (every `every_s` from the planned start), so that a
        resumed attempt keeps the grid and burst ids never repeat."""
        b = self.stage.bursts
        assert b is not None
        chooser = single(b.prompt_tokens, b.max_tokens).chooser(self._seed() + 1)
        every = b.every_s * self.scale
        k = int(max(0.0, time.monotonic() - self.t_start) // every) + 1
        while self.t_start + k * every < self.t_end:
            gevent.sleep(max(0.0, self.t_start + k * every - time.monotonic()))
            if self.terminating is not None:
                return
            specs = [
                self._spec(k * b.size + i, chooser, arrival="burst",
                           burst_id=f"{self.manifest.run_id}.burst.{k:05d}",
                           concurrency=b.size, intended_start_ns=time.monotonic_ns())
                for i in range(b.size)
            ]  # fmt: skip
            jobs = [self.senders.spawn(self.session.send, s) for s in specs]
            self.plan["bursts_sent"] = int(self.plan.get("bursts_sent", 0)) + 1
            k += 1
            gevent.joinall(jobs, timeout=self.stage.pass_.max_request_s * self.scale + 5)
