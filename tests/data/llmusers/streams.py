"""A programmed user that reads streams as they arrive, cancels, and uses a TaskSet."""

from locust import TaskSet, constant, task

from calculet_load.locust import LLMUser


class Nested(TaskSet):
    @task
    def inner(self):
        self.user.llm.complete(prompt_tokens=16, max_tokens=8, name="nested", cancel_after_tokens=2)
        self.interrupt()


class Streamer(LLMUser):
    wait_time = constant(0)
    tasks = {Nested: 1}  # noqa: RUF012 - Locust's own way to weigh a TaskSet

    @task(3)
    def streamed(self):
        stream = self.llm.stream_chat(prompt_tokens=16, max_tokens=32, name="streamed")
        for i, _ev in enumerate(stream):
            if i == 2:
                break  # leaving the loop cancels the stream
        assert stream.result.cancelled
