"""The two-turn user, with the texts it sent and got written where the test can read them
(outside the run folder): the test looks for them in everything the run wrote."""

import json
import os

from locust import constant, task

from calculet_load.locust import LLMUser

SPY = os.environ["SPY_LOG"]


class TwoTurns(LLMUser):
    wait_time = constant(0)

    @task
    def talk(self):
        msgs = [{"role": "user", "content": "Tell me about the sea, in the old words."}]
        first = self.llm.chat(msgs, max_tokens=16, name="turn1")
        msgs += [
            {"role": "assistant", "content": first.text},
            {"role": "user", "content": "And the sky above the harbour?"},
        ]
        second = self.llm.chat(msgs, max_tokens=8, name="turn2")
        with open(SPY, "a") as f:
            f.write(json.dumps([first.text, second.text]) + "\n")
