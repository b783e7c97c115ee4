"""A programmed user that sends a prompt it wrote (no tokenizer needed)."""

from locust import constant, task

from calculet_load.locust import LLMUser


class Written(LLMUser):
    wait_time = constant(0.05)

    @task
    def ask(self):
        self.llm.complete("Once upon a time", max_tokens=4, name="written")
