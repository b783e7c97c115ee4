"""The programmed user benchmarks/client_speed.py measures as client `llmuser`: the same
request as its built-in workload (128 prompt tokens, 64 output tokens, OpenAI completions),
sent from a task through `self.llm`, so the difference in CPU per request is what a
programmed call adds."""

from locust import constant, task

from calculet_load.locust import LLMUser


class Programmed(LLMUser):
    wait_time = constant(0)

    @task
    def ask(self):
        self.llm.complete(prompt_tokens=128, max_tokens=64, name="p128-o64")
