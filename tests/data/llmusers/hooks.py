"""Live hooks beside a programmed user: when each first token is seen, against its stamps."""

import json
import os
import time

from locust import constant, task

from calculet_load.events import events
from calculet_load.locust import LLMUser

OUT = os.environ["HOOK_LOG"]
seen = {}


@events.first_token.add_listener
def _first(request_id, arrival_ns, **kw):
    seen[request_id] = (time.monotonic_ns(), arrival_ns)


@events.request_done.add_listener
def _done(record, outcome, **kw):
    first = seen.pop(record.request_id, (None, None))
    row = {
        "id": record.request_id,
        "ok": outcome.ok,
        "seen_ns": first[0],
        "arrival_ns": first[1],
        "t4": record.client_ns.first_token,
        "t6": record.client_ns.response_end,
    }
    with open(OUT, "a") as f:
        f.write(json.dumps(row) + "\n")


class Hooked(LLMUser):
    wait_time = constant(0)

    @task
    def ask(self):
        self.llm.complete(prompt_tokens=16, max_tokens=40, name="hooked")
