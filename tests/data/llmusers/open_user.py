"""A programmed user whose task the dispatcher runs at each scheduled arrival."""

from locust import task

from calculet_load.locust import LLMUser


class Opener(LLMUser):
    @task
    def ask(self):
        self.llm.complete(prompt_tokens=32, max_tokens=4, name="ask")
