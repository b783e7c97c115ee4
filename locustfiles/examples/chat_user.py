"""A custom chat user: each task sends one chat request, measured like the built-ins.

    locust -f locustfiles/examples/chat_user.py --headless -H http://127.0.0.1:8000 \\
        -u 4 -r 4 -t 30s
"""

from locust import between, task

from calculet_load.locust import LLMUser


class Chat(LLMUser):
    wait_time = between(0.5, 1.5)

    @task
    def ask(self):
        self.llm.chat([{"role": "user", "content": "Name three seas."}], max_tokens=32)
