"""Locust users you program: `LLMUser`, whose `self.llm` is calculet-load's measured client.

    from locust import constant, task
    from calculet_load.locust import LLMUser

    class Chat(LLMUser):
        wait_time = constant(0)

        @task
        def talk(self):
            first = self.llm.chat([{"role": "user", "content": "Hi"}], max_tokens=16)
            ...

Each call is one request through this process's session (calculet_load.locust.worker):
the same timed client and I/O engine, sink, self-watch and statistics as the built-in
workloads, so it gives one record (every stamp, the server join, its token events), one
Locust request event named by the call's `name` (default: the protocol), and its figures
in the LLM tab, CSV, HTML and Prometheus. What comes back is an `LLMResult`, with the
generated text in memory only.

Who says when: in a closed loop (`--arrival closed`) Locust runs the users' tasks
(`wait_time`, weights, TaskSets, `-u/-r`, the web UI, --processes, master/workers). In an
open loop or bursts (`--arrival poisson|constant|gamma|replay|burst`, or a user class's
`arrival` attribute) the process's dispatcher does: at each scheduled instant it lends an
idle instance of a user class (created as needed, its `on_start` run once) one task, and
the first call that task makes is the arrival (its intended time, lateness and the
latency from it are recorded; an arrival that finds `--max-in-flight` tasks running is a
`dropped` record). Users say what to send; the dispatcher says when.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import gevent
import gevent.pool
import gevent.queue
from locust import User
from locust.exception import InterruptTaskSet, RescheduleTask, StopUser
from locust.user.task import TaskSet

from calculet_load.locust.state import STATE
from calculet_load.locust.worker import OPEN_LOOP, Worker
from calculet_load.measure.outcome import StreamCancel
from calculet_load.measure.result import LLMResult
from calculet_load.schema.records import TokenEvent
from calculet_load.workload.calls import Labels, Messages
from calculet_load.workload.conversation import Conversation
from calculet_load.workload.dispatch import FailPause

log = logging.getLogger("calculet_load")

READY_WAIT_S = 1.0  # a call waits for the process's start-up this long at a time


class NoRun(RuntimeError):
    """A call made outside a running Locust test (nothing to send it through)."""


@dataclasses.dataclass(frozen=True, slots=True)
class StreamEvent:
    """One token event of a stream, as it arrived: its text (memory only), a reasoning
    model's thinking in it, the tokens it carried and its arrival stamp."""

    index: int
    tokens: int
    arrival_ns: int
    text: str = dataclasses.field(repr=False)
    reasoning: str = dataclasses.field(repr=False)


class LLMStream:
    """A call whose token events a task reads as they arrive:

        stream = self.llm.stream_chat(messages, max_tokens=64)
        for ev in stream:
            if "stop" in ev.text:
                stream.cancel()  # recorded as cancelled, with its tokens so far
        result = stream.result

    The request runs in a greenlet of its own (in the worker's `streams`, which the
    run's stop ends as it ends every request) while the task reads; leaving the loop
    early cancels it at its next event. `result` waits for its end."""

    _END = object()

    def __init__(
        self,
        send: Callable[[StreamCancel, Callable[..., None]], LLMResult],
        cancel: StreamCancel,
        group: gevent.pool.Group,
    ) -> None:
        self._send = send
        self._cancel = cancel
        self._group = group
        self._queue: gevent.queue.Queue[Any] = gevent.queue.Queue()
        self._greenlet: gevent.Greenlet[..., Any] | None = None
        self._result: LLMResult | None = None

    def _start(self) -> None:
        if self._greenlet is None:
            self._greenlet = self._group.spawn(self._run)

    def _run(self) -> LLMResult:
        def on_token(ev: TokenEvent, text: str, reasoning: str) -> None:
            self._queue.put(StreamEvent(ev.event_index, ev.tokens, ev.arrival_ns, text, reasoning))

        try:
            return self._send(self._cancel, on_token)
        finally:
            self._queue.put(self._END)

    def __iter__(self) -> Iterator[StreamEvent]:
        self._start()
        done = False
        try:
            while True:
                item = self._queue.get()
                if item is self._END:
                    done = True
                    return
                yield item
        except gevent.GreenletExit:
            # the run's stop killed the reader while it waited for an event: the stream
            # is cut by the stop, not cancelled by the task
            self._cancel.stop_run()
            raise
        finally:
            # The reader left early: end the stream (at its next event). No wait here:
            # a generator is closed when it is dropped, where switching greenlets is not
            # safe, and a killed user must die at once.
            if not done:
                self._cancel.cancel()

    def cancel(self) -> None:
        """End the stream at its next event; recorded `cancelled`, its tokens so far kept."""
        self._cancel.cancel()

    def wait(self) -> LLMResult:
        """The call's result, once the request has ended (it is read to its end)."""
        self._start()
        assert self._greenlet is not None
        if self._result is None:
            self._result = self._greenlet.get()
        return self._result

    @property
    def result(self) -> LLMResult:
        return self.wait()


class LLMClient:
    """`self.llm` of an `LLMUser`: measured calls to the run's target."""

    def __init__(self, user: User) -> None:
        self.user = user
        self.pause = FailPause()
        # an open loop's arrival, for the task's first call (the dispatcher sets it)
        self.arrival: Labels | None = None

    # --- the process's share of the run ---------------------------------------------
    def _worker(self) -> Worker:
        w = STATE.worker
        if w is None:
            if self.user.environment.runner is not None:
                gevent.sleep(0.5)  # the run was refused or has stopped: this user ends
                raise StopUser()
            raise NoRun("self.llm calls run inside a Locust test (from a user's task)")
        while not w.wait_ready(READY_WAIT_S):  # start-up is not load: prompts, connections
            if w.stopping or STATE.worker is not w:
                raise StopUser()
        return w

    def _labels(self, w: Worker) -> Labels:
        """The next call's labels: an open loop's arrival once, then the run's kind."""
        arrival, self.arrival = self.arrival, None
        if arrival is not None:
            return arrival
        if w.plan.arrival == "closed":
            return Labels(arrival="closed", concurrency=w.target_users or None)
        return Labels(arrival=w.plan.arrival)

    def _call(self, protocol: str, cancel: StreamCancel | None, **kw: Any) -> LLMResult:
        w = self._worker()
        labels = kw.pop("labels", None) or self._labels(w)
        result = w.caller.call(protocol, cancel=cancel, labels=labels, **kw)
        self._after(w, result)
        return result

    def _after(self, w: Worker, result: LLMResult) -> None:
        """A closed loop's pause after a request the target never answered (FailPause)."""
        if w.plan.arrival == "closed":
            self.pause.wait(result.error_class, result.unanswered)

    def _completion_protocol(self) -> str:
        """`complete()`'s endpoint: llama.cpp's native `/completion` where the run's
        `--protocol` is `llama`, else OpenAI's `/v1/completions`."""
        w = STATE.worker
        return "llama" if w is not None and w.opts.protocol == "llama" else "openai-completions"

    def _max_tokens(self, max_tokens: int | None) -> int:
        if max_tokens is not None:
            return max_tokens
        w = STATE.worker
        return int(w.opts.max_tokens) if w is not None else 32

    # --- calls --------------------------------------------------------------------------
    def chat(
        self,
        messages: Messages | None = None,
        *,
        prompt_tokens: int | None = None,
        max_tokens: int | None = None,
        name: str | None = None,
        cancel_after_tokens: int | None = None,
        **body: Any,
    ) -> LLMResult:
        """One chat request (`/v1/chat/completions`): `messages` as written, or
        `prompt_tokens`: one user message of exactly that many tokens (chat template
        included), unique to this request as the built-in workloads' are. `max_tokens`:
        the run's `--max-tokens` unless given. `body`: more fields for the request body
        (tools, response_format, ...); `stream`, `temperature`, `seed`, `ignore_eos`
        (on by default, as in the built-in workloads) are the call's own."""
        return self._request("openai-chat", messages, prompt_tokens, max_tokens, name,
                             cancel_after_tokens, body)  # fmt: skip

    def complete(
        self,
        prompt: str | list[int] | None = None,
        *,
        prompt_tokens: int | None = None,
        max_tokens: int | None = None,
        name: str | None = None,
        cancel_after_tokens: int | None = None,
        **body: Any,
    ) -> LLMResult:
        """One completion: llama.cpp's native `/completion` where `--protocol llama` (its
        `n_predict` is `max_tokens`), else `/v1/completions`; `prompt` as text or token
        ids, or `prompt_tokens` of exact length, unique to this request."""
        return self._request(self._completion_protocol(), prompt, prompt_tokens, max_tokens,
                             name, cancel_after_tokens, body)  # fmt: skip

    def stream_chat(
        self,
        messages: Messages | None = None,
        *,
        prompt_tokens: int | None = None,
        max_tokens: int | None = None,
        name: str | None = None,
        cancel_after_tokens: int | None = None,
        **body: Any,
    ) -> LLMStream:
        """`chat`, its token events read as they arrive (`LLMStream`)."""
        return self._stream("openai-chat", messages, prompt_tokens, max_tokens, name,
                            cancel_after_tokens, body)  # fmt: skip

    def stream_complete(
        self,
        prompt: str | list[int] | None = None,
        *,
        prompt_tokens: int | None = None,
        max_tokens: int | None = None,
        name: str | None = None,
        cancel_after_tokens: int | None = None,
        **body: Any,
    ) -> LLMStream:
        """`complete`, its token events read as they arrive (`LLMStream`)."""
        return self._stream(self._completion_protocol(), prompt, prompt_tokens, max_tokens,
                            name, cancel_after_tokens, body)  # fmt: skip

    def conversation(
        self,
        system: str | None = None,
        *,
        shared_prefix_tokens: int = 0,
        name: str | None = None,
    ) -> Conversation:
        """A chat session: each `say(content, max_tokens=...)` or `say(prompt_tokens=N,
        max_tokens=...)` sends the history with a new user turn and keeps the answer.
        `system`: a system prompt; `shared_prefix_tokens`: one of that many tokens that
        every session of the run shares (what a prefix cache serves across sessions)."""
        w = self._worker()
        return Conversation(
            w.caller,
            w.sessions.next_id(),
            system=system,
            shared_prefix_tokens=shared_prefix_tokens,
            name=name,
            labels=lambda: self._labels(w),
            after=lambda r: self._after(w, r),
        )

    def _request(
        self,
        protocol: str,
        given: Any,
        prompt_tokens: int | None,
        max_tokens: int | None,
        name: str | None,
        cancel_after_tokens: int | None,
        body: dict[str, Any],
    ) -> LLMResult:
        cancel = StreamCancel(cancel_after_tokens) if cancel_after_tokens is not None else None
        return self._call(protocol, cancel, **_call_args(protocol, given, prompt_tokens,
                          self._max_tokens(max_tokens), name, body))  # fmt: skip

    def _stream(
        self,
        protocol: str,
        given: Any,
        prompt_tokens: int | None,
        max_tokens: int | None,
        name: str | None,
        cancel_after_tokens: int | None,
        body: dict[str, Any],
    ) -> LLMStream:
        kw = _call_args(protocol, given, prompt_tokens, self._max_tokens(max_tokens), name, body)
        w = self._worker()
        labels = self._labels(w)  # taken now: the stream is this task's call

        def send(cancel: StreamCancel, on_token: Callable[..., None]) -> LLMResult:
            return self._call(protocol, cancel, on_token=on_token, labels=labels, **kw)

        return LLMStream(send, StreamCancel(cancel_after_tokens), w.streams)


def _call_args(
    protocol: str,
    given: Any,
    prompt_tokens: int | None,
    max_tokens: int,
    name: str | None,
    body: dict[str, Any],
) -> dict[str, Any]:
    """`Caller.call`'s keywords of a call: its own arguments out of `body`."""
    own: dict[str, Any] = {
        k: body.pop(k) for k in ("stream", "temperature", "seed", "ignore_eos") if k in body
    }
    key = "messages" if protocol == "openai-chat" else "prompt"
    return {key: given, "prompt_tokens": prompt_tokens, "max_tokens": max_tokens,
            "name": name, "body": body, **own}  # fmt: skip


class LLMUser(User):
    """A Locust user whose `self.llm` sends measured requests (see the module's doc).

    Class attributes: `arrival` (an open-loop shape, `poisson`, `constant`, `gamma`,
    `replay` or `burst`) and `rate` (arrivals per second, all workers together) pace
    this class's tasks by calculet's dispatcher when the command line does not give
    `--arrival`/`--rate`."""

    abstract = True
    arrival: str | None = None
    rate: float | None = None

    def __init__(self, environment: Any) -> None:
        super().__init__(environment)
        self.llm = LLMClient(self)

    # Locust declares `run` final; this override only adds the open loop's wait in front
    # of it (an instance Locust spawns must not send on its own pace there)
    def run(self) -> None:  # type: ignore[misc]
        """Locust's loop in a closed loop; in an open loop this instance waits: the
        dispatcher runs tasks on instances it lends them (`ProgrammedTasks`)."""
        w = STATE.worker
        if w is not None and w.tasks is not None and w.plan.arrival != "closed":
            while True:  # Locust kills it at the stop
                gevent.sleep(3600)
        super().run()


# ------------------------------------------------------------------ open-loop tasks
def programmed(user_classes: list[type[User]]) -> list[type[LLMUser]]:
    """The user classes whose tasks the dispatcher runs in an open loop: LLMUsers with
    tasks of their own (the built-in `CalculetUser` has the process's own workload)."""
    return [
        c
        for c in user_classes
        if issubclass(c, LLMUser) and c.tasks and not getattr(c, "builtin", False)
    ]


class ProgrammedTasks:
    """Open loop and bursts of programmed users: arrival k runs one task of one user
    class, both chosen from (seed, k) by their weights, on an idle instance."""

    def __init__(self, env: Any, classes: list[type[LLMUser]], seed: int) -> None:
        self.env = env
        self.classes = classes
        self.seed = seed
        weights = [max(int(getattr(c, "weight", 1) or 1), 1) for c in classes]
        self._pick = [c for c, n in zip(classes, weights, strict=True) for _ in range(n)]
        self.idle: dict[type[LLMUser], list[LLMUser]] = {c: [] for c in classes}
        self.lent: list[LLMUser] = []

    def _draw(self, k: int, salt: str, n: int) -> int:
        digest = hashlib.blake2b(f"{self.seed}:{k}:{salt}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big") % n

    def choose(self, k: int) -> tuple[type[LLMUser], Any]:
        """Arrival k's user class and task: a function, or (a TaskSet class, one of its
        tasks), drawn by weight as Locust draws them."""
        cls = self._pick[self._draw(k, "user", len(self._pick))]
        task: Any = cls.tasks[self._draw(k, "task", len(cls.tasks))]
        if isinstance(task, type) and issubclass(task, TaskSet):
            if not task.tasks:
                raise TypeError(f"{cls.__name__}: TaskSet {task.__name__} has no tasks")
            task = (task, task.tasks[self._draw(k, "taskset", len(task.tasks))])
        return cls, task

    def name_of(self, task: Any) -> str:
        fn = task[1] if isinstance(task, tuple) else task
        return str(getattr(fn, "__name__", "task"))

    def cell_of(self, k: int) -> str:
        """The name a dropped arrival k is recorded under: its task's."""
        return self.name_of(self.choose(k)[1])

    def run(self, k: int, labels: Labels) -> None:
        """Run arrival k's task on a lent instance; its first call carries `labels`."""
        cls, task = self.choose(k)
        user = self._lend(cls)
        user.llm.arrival = labels
        try:
            if isinstance(task, tuple):
                ts_cls, fn = task
                fn(ts_cls(user))
            else:
                task(user)
        except (StopUser, InterruptTaskSet, RescheduleTask, gevent.GreenletExit):
            pass
        except Exception as exc:  # a task's own bug: Locust's user_error, as Locust does
            log.exception("%s: task %s failed", cls.__name__, self.name_of(task))
            self.env.events.user_error.fire(user_instance=user, exception=exc, tb=None)
        finally:
            user.llm.arrival = None
            self.idle[cls].append(user)

    def _lend(self, cls: type[LLMUser]) -> LLMUser:
        pool = self.idle[cls]
        if pool:
            return pool.pop()
        user = cls(self.env)
        self.lent.append(user)
        try:
            user.on_start()
        except Exception:
            log.exception("%s.on_start failed", cls.__name__)
        return user

    def stop(self) -> None:
        """`on_stop` of every instance the dispatcher made."""
        for user in self.lent:
            try:
                user.on_stop()
            except Exception:
                log.exception("%s.on_stop failed", type(user).__name__)
        self.lent.clear()


__all__ = ["OPEN_LOOP", "LLMClient", "LLMResult", "LLMStream", "LLMUser", "StreamEvent"]
