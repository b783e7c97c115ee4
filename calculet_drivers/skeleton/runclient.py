"""The client a driver sends through, set up once: the run context, the
Parquet sink, the session (one per timeout where a driver needs several), the prompt
factory sized as the manifest's target says with its cache, and the self-watch (started
by the drivers that judge their own process: accept and the soak).

Accept, the soak, the fault matrix and the capacity search each open one `RunClient`
and close it when their run ends; what differs between them is a parameter here (the
session's bound on requests in flight, a session type of their own),
never a copy of the set-up.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from calculet_drivers.skeleton.runtarget import RunTarget
from calculet_load.errors import EXIT_INFRA, EXIT_INVALID, RunStop
from calculet_load.measure.heap import PACER
from calculet_load.measure.outcome import Timeouts
from calculet_load.measure.prompts import (
    Prompt,
    PromptBook,
    PromptFactory,
    WorkloadError,
    target_prompts,
)
from calculet_load.measure.selfwatch import SelfWatch
from calculet_load.measure.session import RunContext, Session
from calculet_load.measure.sink import PartSink
from calculet_load.schema.manifest import RunManifest
from calculet_load.target.api import off_loop

__all__ = ["RunClient"]


@dataclasses.dataclass(eq=False)
class RunClient:
    """What a driver sends through. `session` is the one bounded by the manifest's
    `timeout_s`; `session_for(t)` the one bounded by `t` real seconds (made on first use,
    of `make_session`: a driver's own Session type, e.g. the fault matrix's ids shared
    between its sessions). Every session sends through `target.access` (TLS, base path,
    headers, API key), speaks `target.protocol`, writes to `sink`, and sends prompts as
    built only when the manifest's `target.prompt_reuse` says so. `prompt(tokens,
    sample)` builds (tokenizes off the gevent loop) once and then reuses; `book` holds
    them, and those of the other protocols a conversation speaks."""

    manifest: RunManifest
    target: RunTarget
    ctx: RunContext
    sink: PartSink
    factory: PromptFactory
    max_in_flight: int
    watch: SelfWatch
    make_session: Callable[..., Session] = Session
    sessions: dict[float | None, Session] = dataclasses.field(default_factory=dict)
    book: PromptBook | None = None
    paced: bool = False  # this client started the process's heap pacer (measure.heap)

    @classmethod
    def open(
        cls,
        manifest: RunManifest,
        target: RunTarget,
        run_dir: Path | str,
        worker: str,
        *,
        max_in_flight: int,
        make_session: Callable[..., Session] = Session,
    ) -> RunClient:
        """The client of `worker`, writing its parts under `run_dir`; its `watch` samples
        this process into the sink once the driver starts it."""
        sink = PartSink(str(run_dir), worker)
        client = cls(
            manifest,
            target,
            RunContext.from_manifest(manifest, worker),
            sink,
            target_prompts(target.access, target.protocol, manifest.target, off_loop=off_loop),
            max_in_flight,
            SelfWatch(sink, worker),
            make_session,
        )
        client.watch.in_flight = lambda: client.session.in_flight
        # start-up's objects frozen and the collections paced, as in a Locust worker: a
        # full collection of a driver's heap held its loop 40-140 ms (measure.heap)
        PACER.start()
        client.paced = True
        return client

    @property
    def prompt_reuse(self) -> bool:
        return bool(self.manifest.target and self.manifest.target.prompt_reuse)

    @property
    def session(self) -> Session:
        """The session bounded by the manifest's timeout."""
        return self.session_for(None)

    def session_for(self, timeout_s: float | None) -> Session:
        """The session whose requests are bounded by `timeout_s` real seconds (None: the
        manifest's `timeout_s`); sessions of timeouts equal to the millisecond are one."""
        key = None if timeout_s is None else round(timeout_s, 3)
        if key not in self.sessions:
            self.sessions[key] = self.make_session(
                self.ctx,
                self.target.access,
                self.target.protocol,
                model=self.target.model,
                max_in_flight=self.max_in_flight,
                timeouts=Timeouts.within(self.manifest.timeout_s if key is None else key),
                sink=self.sink,
                prompt_reuse=self.prompt_reuse,
                count_text=self.factory.count_text,
            )
        return self.sessions[key]

    def prompt(self, tokens: int, sample: int) -> Prompt:
        """The prompt of exactly `tokens` tokens from corpus sample `sample`, built once."""
        return self.prompts(self.target.protocol, tokens, sample)

    def checked_prompt(self, tokens: int, sample: int) -> Prompt:
        """`prompt`, or RunStop: exit 2 for a prompt the target cannot take, 3 when its
        tokenizer cannot be reached."""
        try:
            return self.prompt(tokens, sample)
        except WorkloadError as exc:
            raise RunStop(EXIT_INVALID, f"prompt: {exc}") from None
        except OSError as exc:
            raise RunStop(EXIT_INFRA, f"prompt: /tokenize unreachable: {exc}") from None

    @property
    def prompts(self) -> PromptBook:
        """The prompts of every protocol (a conversation's turns are chat)."""
        if self.book is None:
            access, target = self.target.access, self.manifest.target
            self.book = PromptBook(
                lambda protocol: target_prompts(access, protocol, target, off_loop=off_loop),
                {self.target.protocol: self.factory},
            )
        return self.book

    def close(self) -> None:
        """The self-watch stopped, every session's connections closed, the sink's last
        part written."""
        self.watch.stop()
        for session in self.sessions.values():
            session.close()
        self.sink.close()
        if self.paced:
            self.paced = False
            PACER.stop()
