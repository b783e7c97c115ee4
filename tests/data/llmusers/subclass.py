"""A CalculetUser subclass with a task of its own: only its task runs, through self.llm."""

from locust import constant, task

from calculet_load.locust import CalculetUser


class MyChat(CalculetUser):
    wait_time = constant(0)

    @task
    def mine(self):
        self.llm.chat(prompt_tokens=16, max_tokens=4, name="mine")
