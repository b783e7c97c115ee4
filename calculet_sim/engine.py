# size: the simulated device's scheduler and timing model share one loop's state
"""The device scheduler: admission, slots, KV budget, buffer leases, and device jobs.

One asyncio task per job pipeline (two with ping/pong) picks the next job — a prefill
of one sequence, else a decode step over up to B active lanes — and runs its phases:
host prepare/H2D/BF16, then the device Wait (one device, so jobs serialise there), then
D2H and sampling. A decode step costs the same with 1 or B active lanes. Every phase is
a trace event; every request-step is a `steps.jsonl` row. Faults hook in at submit, Wait,
output status and output corruption (spec §11).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import random
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from calculet_load.schema import ServerEvent, ServerEventRow, StepRow
from calculet_sim.device import DeviceModel
from calculet_sim.faults import FaultInjector
from calculet_sim.prefix_cache import PrefixCache
from calculet_sim.profile import Profile
from calculet_sim.tokens import EOS, WORD_BASE, OutputModel, TextOut, Tokenizer, key_of, splitmix64
from calculet_sim.traces import TraceWriter, now_ns

UINT32_MAX = 2**32 - 1
# The event loop's timers wake in whole milliseconds (epoll), so a shorter sleep costs
# about 1 ms; sleeps below this are owed rather than slept (see Engine.sleep_ms).
_MIN_SLEEP_S = 0.001
# A task that did not sleep for this long was idle: its debt or credit is dropped.
_PACE_GAP_S = 0.002


class Reject(Exception):
    """A request refused before or during admission: becomes a JSON error response."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


class GenRequest:
    __slots__ = (
        "cache_prompt",
        "followup",
        "ignore_eos",
        "length_field",
        "max_tokens",
        "model",
        "prompt_ids",
        "protocol",
        "request_id",
        "seed",
        "temperature",
        "thinking",
    )

    def __init__(
        self,
        request_id: str,
        prompt_ids: list[int],
        max_tokens: int,
        *,
        ignore_eos: bool = False,
        temperature: float = 0.0,
        seed: int | None = None,
        model: str | None = None,
        length_field: str = "max_tokens",
        protocol: str = "llama",
        cache_prompt: bool = True,
        thinking: bool = True,
        followup: Callable[[str], list[int]] | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.max_tokens = max_tokens
        self.ignore_eos = ignore_eos
        self.temperature = temperature
        self.seed = seed
        self.model = model
        # The wire name of max_tokens (n_predict on llama.cpp), for error messages.
        self.length_field = length_field
        self.protocol = protocol
        # whether the prefix cache serves and keeps it (llama.cpp's cache_prompt)
        self.cache_prompt = cache_prompt
        # a reasoning model thinks first unless told not to (enable_thinking: false)
        self.thinking = thinking
        # the ids a next turn sends for this prompt and its answer text
        self.followup = followup


# Items on a sequence's output queue.
Token = tuple[str, int, int, bool]  # ("token", token_id, step_index, nan)
Item = tuple[Any, ...]


class Seq:
    """One request's sequence on the device."""

    def __init__(self, seq_id: int, req: GenRequest, model: OutputModel, max_new: int) -> None:
        self.seq_id = seq_id
        self.req = req
        self.rid = req.request_id
        self.model = model
        self.prompt_len = len(req.prompt_ids)
        self.max_new = max_new
        self.out: asyncio.Queue[Item] = asyncio.Queue()
        self.state = "waiting"  # waiting -> prefill -> decode -> done
        self.n_generated = 0
        self.n_generated_sent = 0
        self.ids: list[int] = []
        self.slot_held = False
        self.kv_reserved = 0
        self.kv_used = 0
        self.cached_tokens = 0  # of the prompt, served by the prefix cache
        self.lease: int | None = None
        self.shared_lease = False
        self.busy = False
        self.cancelled = False
        self.admitted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.blocked_on = "slot"  # what admission last waited for: slot, kv or buffer
        self.ready_mono = 0
        self.generation = 0

    @property
    def done(self) -> bool:
        return self.state == "done"


class Job:
    __slots__ = ("generation", "job_id", "kind", "seqs")

    def __init__(self, job_id: int, kind: str, seqs: list[Seq], generation: int) -> None:
        self.job_id, self.kind, self.seqs, self.generation = job_id, kind, seqs, generation


class Engine:
    """State of one simulated Calculet instance."""

    def __init__(
        self, profile: Profile, traces: TraceWriter, faults: FaultInjector, tok: Tokenizer
    ) -> None:
        self.p = profile
        self.traces = traces
        self.faults = faults
        self.tok = tok
        pc = profile.prefix_cache
        self.cache = PrefixCache(
            pc.block_tokens, pc.capacity_tokens or profile.scheduling.kv_budget_tokens
        )
        self.scale = 0.0 if profile.firehose else profile.time_scale
        self.rng = random.Random(profile.seed)
        self.device = DeviceModel(profile.device)
        self.state = "ready"
        self.generation = 1
        self.calbin_sha256 = profile.versions.get("calbin_sha256", "")
        self.waiting: collections.deque[Seq] = collections.deque()
        self.active: dict[int, Seq] = {}
        self._prefill: collections.deque[Seq] = collections.deque()
        self._ring: list[Seq] = []
        self._ring_pos = 0
        self._seq_ids = itertools.count(1)
        self._job_ids = itertools.count(1)
        self.slots_in_use = 0
        self.kv_allocated = 0
        self.kv_quarantined = 0
        self.leases: dict[int, int] = {}  # lease -> seq_id
        self.leases_quarantined = 0
        self.leases_held_by_fault = 0
        self.leases_leaked = 0
        self.quarantined_total = 0
        self.kv_waits = 0
        self.kv_rejects = 0
        self.buffer_waits = 0
        self.pending_jobs = 0
        self.left_jobs = 0
        self.finished_jobs = 0
        self.reset_count = 0
        self.generation_changes = 0
        self.counters: collections.Counter[str] = collections.Counter()
        self.isolated_shapes: set[str] = set()
        self.busy_ns = 0
        self._warm_left = profile.timing.warmup_requests
        self._last_reset_ns: int | None = None
        self._backoff_ms = profile.scheduling.reset_min_interval_ms
        self._resetting = False
        self._device_lock = asyncio.Lock()
        self._work = asyncio.Event()
        self.idle = asyncio.Event()
        self.idle.set()
        self._tasks: list[asyncio.Task[None]] = []
        self._leak_rss: list[bytes] = []
        self._leak_fds: list[Any] = []
        self.unavailable_until_ns = 0
        self.metrics: Any = None  # SimMetrics, set by the server
        # Per task: (sleep owed in s, negative = overslept; when it last slept), sleep_ms.
        self._pace = weakref.WeakKeyDictionary[asyncio.Task[Any], tuple[float, float]]()

    # ----------------------------------------------------------------- plumbing
    def event(self, event: ServerEvent, seq: Seq | None = None, **kw: Any) -> None:
        if not self.traces.enabled("server_events"):
            return
        wall, mono = now_ns()
        detail = kw.pop("detail", None)
        if seq is not None and "job_id" in kw and kw.get("step_index") is None:
            # A job event of a sequence belongs to the step that sequence is running.
            kw["step_index"] = seq.n_generated
        self.traces.write(
            "server_events",
            ServerEventRow(
                wall_ns=wall,
                mono_ns=mono,
                event=event,
                request_id=seq.rid if seq else None,
                seq_id=seq.seq_id if seq else None,
                generation=self.generation,
                detail=detail,
                **kw,
            ),
        )

    async def sleep_ms(self, ms: float) -> None:
        """Let `ms` simulated milliseconds pass (`ms * time_scale` real ones).

        The loop's timers wake on whole milliseconds, so sleeping each phase would cost
        ~1 ms however short it is, and a small time scale would run many times slower
        than asked. Instead each task owes its short phases and sleeps once the debt
        reaches a millisecond; what one wake-up oversleeps is taken off the next phases.
        Over a job the slept time matches the model; a single sub-ms phase is lumpy.
        """
        if ms <= 0 or self.scale <= 0:
            return
        task = asyncio.current_task()
        now = time.monotonic()
        owed, last = self._pace.get(task, (0.0, 0.0)) if task is not None else (0.0, 0.0)
        if now - last > _PACE_GAP_S:
            owed = 0.0  # idle since: the old debt or credit belongs to no one now
        owed += ms * self.scale / 1000.0
        if owed >= _MIN_SLEEP_S:
            await asyncio.sleep(owed)
            end = time.monotonic()
            owed = max(owed - (end - now), -_MIN_SLEEP_S)
        else:
            await asyncio.sleep(0)
            end = time.monotonic()
        if task is not None:
            self._pace[task] = (owed, end)

    def set_state(self, state: str, reason: str) -> None:
        if state != self.state:
            self.event(
                ServerEvent.STATE_CHANGE, detail={"from": self.state, "to": state, "why": reason}
            )
            self.state = state
        self._work.set()
        if state == "ready":
            self.try_admit()

    def start(self, n_pipelines: int) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._worker()) for _ in range(n_pipelines)]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for f in self._leak_fds:
            f.close()

    # --------------------------------------------------------------- admission
    def output_limit(self, req: GenRequest) -> int:
        """Validate lengths (400 before submit, device untouched); the tokens to generate."""
        sched = self.p.scheduling
        n_prompt = len(req.prompt_ids)
        broken = self.faults.broken("illegal_length")
        max_new = req.max_tokens
        if broken:
            max_new &= UINT32_MAX  # a C wrapper's uint32 cast: 2**32 + 8 becomes 8
        else:
            field = req.length_field
            if n_prompt == 0:
                raise Reject(400, "invalid_length", "prompt: must contain at least 1 token")
            if n_prompt > sched.max_context:
                raise Reject(
                    400,
                    "context_length_exceeded",
                    f"prompt: {n_prompt} tokens exceed max context {sched.max_context}",
                )
            if not 1 <= max_new <= UINT32_MAX:
                raise Reject(400, "invalid_length", f"{field}: {max_new} outside 1..{UINT32_MAX}")
            if n_prompt + max_new > sched.max_context:
                if sched.context_overflow == "reject":
                    raise Reject(
                        400,
                        "context_length_exceeded",
                        f"{field}: prompt {n_prompt} + {field} {max_new} exceed max context "
                        f"{sched.max_context}",
                    )
                max_new = sched.max_context - n_prompt
        return max(max_new, 1)

    def output_model(self, req: GenRequest, max_new: int) -> OutputModel:
        out, think = self.p.output, self.p.reasoning
        reasoning = 0
        if think.enabled and req.thinking:
            reasoning = min(think.tokens, int(think.max_share * max_new))
        return OutputModel(
            self._sampling_key(req),
            self.tok.words,
            out.multibyte_rate,
            out.eos_probability,
            req.ignore_eos,
            reasoning,
            self.tok.think_ids,
        )

    def text_out(self, req: GenRequest) -> TextOut:
        """The text assembly of one response: chat splits a reasoning model's thoughts
        off when the profile says `separate`; completions carry them inline."""
        think = self.p.reasoning
        separate = think.enabled and think.format == "separate" and req.protocol == "chat"
        return TextOut(self.tok, self.p.output.utf8_holdback, separate)

    def accept(self, req: GenRequest) -> Seq:
        """Validate lengths (400 before submit, device untouched) and create the sequence."""
        n_prompt = len(req.prompt_ids)
        max_new = self.output_limit(req)
        if self.state in ("stopped", "failed"):
            raise Reject(503, "unavailable", f"instance is {self.state}")
        seq = Seq(next(self._seq_ids), req, self.output_model(req, max_new), max_new)
        seq.generation = self.generation
        seq.ready_mono = time.monotonic_ns()
        self.event(
            ServerEvent.ACCEPTED, seq, detail={"prompt_tokens": n_prompt, "max_new": max_new}
        )
        return seq

    def _sampling_key(self, req: GenRequest) -> int:
        # Not keyed on the generation: a golden re-run after a reset or load must match.
        key = key_of(req.prompt_ids) ^ 0x51ED27
        if req.temperature > 0:
            seed = req.seed if req.seed is not None else self.rng.getrandbits(63)
            key = splitmix64(key ^ splitmix64(seed) ^ int(req.temperature * 1000))
        return key

    async def admit(self, seq: Seq) -> None:
        """Wait (bounded) for a slot, KV and a buffer lease; raise Reject on overload."""
        sched = self.p.scheduling
        need = seq.prompt_len + seq.max_new
        if need > sched.kv_budget_tokens:
            # It could never be admitted: say so now instead of after the admission wait.
            self.kv_rejects += 1
            self._reject_event(seq, 400, "kv_budget_exceeded")
            raise Reject(
                400,
                "kv_budget_exceeded",
                f"{seq.req.length_field}: prompt {seq.prompt_len} + {seq.max_new} tokens "
                f"exceed the KV budget of {sched.kv_budget_tokens} tokens",
            )
        if len(self.waiting) >= sched.queue_max:
            self.counters["rejected_queue_full"] += 1
            self._reject_event(seq, 429, "queue_full")
            raise Reject(429, "queue_full", f"admission queue full ({sched.queue_max})")
        self.waiting.append(seq)
        self.try_admit()
        if seq.admitted.done():
            return
        timeout_s = sched.admission_timeout_s * (self.scale or 1.0)
        kv_fault = self.faults.is_active("kv_full", self.scale or 1.0)
        try:
            if kv_fault is not None and kv_fault.broken:
                await self._spin_until_admitted(seq, timeout_s)
            else:
                await asyncio.wait_for(asyncio.shield(seq.admitted), timeout_s)
        except TimeoutError:
            self._drop_waiting(seq)
            if seq.blocked_on == "kv":
                self.kv_rejects += 1
            self.counters["rejected_admission_timeout"] += 1
            self._reject_event(seq, 503, "admission_timeout")
            raise Reject(
                503, "admission_timeout", f"not admitted within {sched.admission_timeout_s} s"
            ) from None

    async def _spin_until_admitted(self, seq: Seq, timeout_s: float) -> None:
        # Broken kv_full: polls in a hot loop instead of waiting for a release.
        deadline = time.monotonic() + timeout_s
        while not seq.admitted.done():
            if time.monotonic() >= deadline:
                raise TimeoutError
            self.try_admit()
            await asyncio.sleep(0)

    def _reject_event(self, seq: Seq, status: int, code: str) -> None:
        self.event(ServerEvent.REJECTED, seq, detail={"http_status": status, "code": code})

    def _drop_waiting(self, seq: Seq) -> None:
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq.slot_held and not seq.admitted.done():
            seq.slot_held = False
            self.slots_in_use -= 1
        self.try_admit()

    def free_leases(self) -> int:
        used = len(self.leases) + self.leases_quarantined + self.leases_held_by_fault
        return self.p.scheduling.buffer_pool_size - used - self.leases_leaked

    def kv_free(self) -> int:
        return self.p.scheduling.kv_budget_tokens - self.kv_allocated - self.kv_quarantined

    def try_admit(self) -> None:
        sched = self.p.scheduling
        scale = self.scale or 1.0
        while self.waiting and self.state == "ready":
            seq = self.waiting[0]
            if not seq.slot_held:
                if self.slots_in_use >= sched.slots:
                    return
                seq.slot_held = True
                self.slots_in_use += 1
                self.event(ServerEvent.SLOT_ASSIGNED, seq)
            need = seq.prompt_len + seq.max_new
            if self.faults.is_active("kv_full", scale) or need > self.kv_free():
                seq.blocked_on = "kv"
                self.kv_waits += 1
                return
            pool_fault = self.faults.is_active("buffer_pool_full", scale)
            shared = False
            if pool_fault is not None or self.free_leases() <= 0:
                if pool_fault is None or not pool_fault.broken or not self.leases:
                    seq.blocked_on = "buffer"
                    self.buffer_waits += 1
                    return
                shared = True  # broken: hands out a buffer another request is using
            self.waiting.popleft()
            self._admit_now(seq, need, shared)

    def _admit_now(self, seq: Seq, need: int, shared: bool) -> None:
        seq.kv_reserved = need
        self.kv_allocated += need
        if self.p.prefix_cache.enabled:
            if seq.req.cache_prompt:
                # the reservation holds the prefix from here on: eviction cannot take it
                seq.cached_tokens = self.cache.lookup(seq.req.prompt_ids)
            self.cache.shrink_to(self.kv_free())
        if shared:
            seq.lease = next(iter(self.leases))
            seq.shared_lease = True
        else:
            lease = next(i for i in itertools.count() if i not in self.leases)
            self.leases[lease] = seq.seq_id
            seq.lease = lease
        seq.state = "prefill"
        seq.ready_mono = time.monotonic_ns()
        self.active[seq.seq_id] = seq
        self.idle.clear()
        self._prefill.append(seq)
        if not seq.admitted.done():
            seq.admitted.set_result(None)
        self.event(
            ServerEvent.ADMITTED,
            seq,
            detail={"kv_reserved": need, "lease": seq.lease, "cached_tokens": seq.cached_tokens},
        )
        self._work.set()

    def wake_later(self, delay_ms: float) -> None:
        """Re-run admission when a timed fault window ends."""
        loop = asyncio.get_running_loop()
        loop.call_later(delay_ms * (self.scale or 1.0) / 1000.0 + 0.001, self.try_admit)

    # ------------------------------------------------------ release & cancel
    def release(self, seq: Seq, *, quarantine: bool = False) -> None:
        """Return a finished/failed sequence's slot, KV and lease (or quarantine them)."""
        if seq.done:
            return
        seq.state = "done"
        self.active.pop(seq.seq_id, None)
        if seq in self._prefill:
            self._prefill.remove(seq)
        if seq in self._ring:
            self._ring.remove(seq)
        if seq.slot_held:
            seq.slot_held = False
            self.slots_in_use -= 1
        self.kv_allocated -= seq.kv_reserved
        # A lease shared by a broken fault belongs to its first owner, who frees it.
        if seq.lease is not None and self.leases.get(seq.lease) == seq.seq_id:
            del self.leases[seq.lease]
        if quarantine:
            self.kv_quarantined += seq.kv_reserved
            self.leases_quarantined += 1
            self.quarantined_total += 1
            self.event(
                ServerEvent.QUARANTINE, seq, detail={"lease": seq.lease, "kv": seq.kv_reserved}
            )
        seq.kv_reserved = 0
        if not self.active:
            self.idle.set()
        self.try_admit()

    def fail(self, seq: Seq, status: int, code: str, message: str, **kw: Any) -> None:
        if seq.done:
            return
        self.counters[f"failed_{code}"] += 1
        self.event(ServerEvent.FAILED, seq, detail={"http_status": status, "code": code})
        if not seq.admitted.done():
            # Still waiting for admission: the waiter raises this as its response.
            seq.admitted.set_exception(Reject(status, code, message))
            self._drop_waiting(seq)
            seq.state = "done"
            return
        seq.out.put_nowait(("error", status, code, message))
        self.release(seq, **kw)

    def cancel(self, seq: Seq) -> None:
        """The client went away (spec §12.1 cancel waiting / cancel submitted)."""
        if seq.done or seq.cancelled:
            return
        seq.cancelled = True
        self.counters["cancelled"] += 1
        if not seq.admitted.done():
            if self.faults.broken("cancel_waiting"):
                # Broken: leaves the request queued; its slot is never given back.
                self.event(
                    ServerEvent.CANCELLED, seq, detail={"where": "waiting", "released": False}
                )
                if seq in self.waiting:
                    self.waiting.remove(seq)
                seq.state = "done"
                return
            self.event(ServerEvent.CANCELLED, seq, detail={"where": "waiting", "released": True})
            self._drop_waiting(seq)
            seq.state = "done"
            return
        if seq.busy:
            if self.faults.broken("cancel_submitted"):
                # Broken: frees the buffers while the device may still write them.
                self.event(
                    ServerEvent.CANCELLED, seq, detail={"where": "submitted", "drained": False}
                )
                self.release(seq)
                return
            # Designed: the Wait is drained by the job; it drops the result.
            self.event(
                ServerEvent.CANCELLED, seq, detail={"where": "submitted", "drained": "pending"}
            )
            return
        self.event(ServerEvent.CANCELLED, seq, detail={"where": "between_steps", "released": True})
        self.release(seq)

    # ------------------------------------------------------------ job picking
    def _pick(self) -> Job | None:
        if self.state not in ("ready", "draining", "loading"):
            return None
        for seq in self._prefill:
            if not seq.busy and not seq.done:
                return Job(next(self._job_ids), "prefill", [seq], self.generation)
        n = len(self._ring)
        if n == 0:
            return None
        lanes: list[Seq] = []
        b = self.p.scheduling.compiled_batch
        for i in range(n):
            seq = self._ring[(self._ring_pos + i) % n]
            if not seq.busy and not seq.done:
                lanes.append(seq)
                if len(lanes) == b:
                    break
        if not lanes:
            return None
        self._ring_pos = (self._ring_pos + len(lanes)) % n
        return Job(next(self._job_ids), "decode", lanes, self.generation)

    async def _worker(self) -> None:
        while True:
            job = self._pick()
            if job is None:
                self._work.clear()
                await self._work.wait()
                continue
            for seq in job.seqs:
                seq.busy = True
            try:
                await self._run_job(job)
            finally:
                for seq in job.seqs:
                    seq.busy = False
                    if seq.cancelled and not seq.done:
                        self.event(
                            ServerEvent.CANCELLED,
                            seq,
                            detail={"where": "submitted", "drained": True},
                        )
                        self.release(seq)
                self._work.set()
            if self.scale == 0:
                await asyncio.sleep(0)

    # -------------------------------------------------------------- cost model
    def _slowdown(self, context: int) -> float:
        factor = 1.0
        for s in self.p.timing.slowdowns:
            if context >= s.from_context:
                factor = max(factor, s.factor)
        return factor

    def _jitter(self) -> float:
        j = self.p.timing.jitter
        return self.rng.lognormvariate(0.0, j) if j > 0 else 1.0

    def device_ms(self, job: Job) -> float:
        t = self.p.timing
        b = self.p.scheduling.compiled_batch
        if job.kind == "prefill":
            # The uncached tokens are computed, each attending to the whole prompt: the
            # quadratic term is what P tokens cost beyond what the cached C did.
            seq = job.seqs[0]
            n, c = seq.prompt_len, seq.cached_tokens
            ms = t.prefill_base_ms + t.prefill_per_token_ms * (n - c)
            ms += t.prefill_per_token_sq_ms * (n * n - c * c)
            ms *= self._slowdown(n)
            if self._warm_left > 0:
                self._warm_left -= 1
                ms += t.warmup_extra_ms
        else:
            ctx = max(s.prompt_len + s.n_generated for s in job.seqs)
            ms = t.decode_base_ms * (1 + t.batch_overhead * (b - 1))
            ms = (ms + t.decode_per_context_token_ms * ctx) * self._slowdown(ctx)
        return ms * self._jitter() * self.device.speed_factor()

    def _host_pre_ms(self, job: Job) -> tuple[float, float, float]:
        t = self.p.timing
        # a prefill sends its uncached tokens, a decode step one token per lane
        prefill = job.kind == "prefill"
        tokens = sum(s.prompt_len - s.cached_tokens if prefill else 1 for s in job.seqs)
        return t.prepare_ms, t.h2d_base_ms + t.h2d_ms_per_mtoken * tokens / 1e6, t.bf16_ms

    # ----------------------------------------------------------------- a job
    async def _run_job(self, job: Job) -> None:
        from calculet_sim.jobs import run_job  # the phases live in their own module

        await run_job(self, job)

    def iter_active(self) -> Iterator[Seq]:
        return iter(list(self.active.values()))

    def step_row(
        self, job: Job, seq: Seq, ms: dict[str, float], step: int, kv_before: int, kv_after: int
    ) -> StepRow:
        wall, mono = now_ns()
        return StepRow(
            wall_ns=wall,
            mono_ns=mono,
            request_id=seq.rid,
            job_id=job.job_id,
            seq_id=seq.seq_id,
            kind=job.kind,  # type: ignore[arg-type]
            step=step,
            queue_ms=ms["queue"],
            prepare_ms=ms["prepare"],
            h2d_ms=ms["h2d"],
            device_wait_ms=ms["device"],
            d2h_ms=ms["d2h"],
            bf16_ms=ms["bf16"],
            sampling_ms=ms["sampling"],
            engine="pingpong" if self.p.scheduling.ping_pong else "sync",
            kv_before=kv_before,
            kv_after=kv_after,
            output_status="done",
        )

    def finish(self, seq: Seq, reason: str) -> None:
        self.counters["finished"] += 1
        self.event(
            ServerEvent.FINISHED,
            seq,
            detail={"finish_reason": reason, "output_tokens": seq.n_generated},
        )
        seq.out.put_nowait(("finish", reason))
        self._cache_followup(seq)
        if self.metrics is not None:
            self.metrics.seq_len.observe(seq.prompt_len + seq.n_generated)
        self._leak(seq)
        self.release(seq)

    def cache_prompt(self, seq: Seq) -> None:
        """Its prefill done, a prompt's blocks are computed KV: later prompts may share it."""
        if self.p.prefix_cache.enabled and seq.req.cache_prompt:
            self.cache.insert(seq.req.prompt_ids, self.kv_free())

    def _cache_followup(self, seq: Seq) -> None:
        """A finished request leaves what its next turn sends: the prompt and the answer
        as the client got its text (re-encoded, and in a chat template's assistant
        message), so a conversation's next turn hits all of its whole blocks."""
        req = seq.req
        if self.p.prefix_cache.enabled and req.cache_prompt and req.followup is not None:
            _, answer = self.text_out(req).whole(seq.ids)
            # its own reservation is free once released: the room counts it
            self.cache.insert(req.followup(answer), self.kv_free() + seq.kv_reserved)

    def _leak(self, seq: Seq) -> None:
        leak = self.p.knobs.leak
        if leak.rss_bytes_per_request:
            self._leak_rss.append(b"\x01" * leak.rss_bytes_per_request)
        self.device.extra_memory_mib += leak.device_mib_per_request
        self.leases_leaked += leak.leases_per_request
        for _ in range(leak.fds_per_request):
            self._leak_fds.append(open("/dev/null", "rb"))  # noqa: SIM115

    def token_for(self, seq: Seq) -> int:
        tok = seq.model.token_at(seq.n_generated)
        if tok == EOS:
            return tok
        if seq.shared_lease:
            # A buffer another live request holds: whatever it wrote leaks into this output.
            return WORD_BASE + self.rng.randrange(self.p.output.vocab_size - WORD_BASE)
        crosstalk = self.p.knobs.crosstalk_probability
        if crosstalk and self.rng.random() < crosstalk:
            # Another request's logits leak into this one: its latest token. Cross-talk
            # needs a second request in flight; a request alone generates its own output.
            others = [s.ids[-1] for s in self.active.values() if s is not seq and s.ids]
            if others:
                tok = self.rng.choice(others)
        return tok
