"""A programmed user paced by its class attributes: bursts, no --arrival given."""

from locust import task

from calculet_load.locust import LLMUser


class Burster(LLMUser):
    arrival = "burst"

    @task
    def ask(self):
        self.llm.chat(prompt_tokens=24, max_tokens=4, name="burst")
