"""Conversations written by hand: each task is a session of four turns after a system
prompt every session shares, so a prefix cache can serve it (the built-in equivalent is
`--mix conversation`).

    locust -f locustfiles/examples/conversation_user.py --headless \\
        -H http://127.0.0.1:8000 -u 8 -r 8 -t 60s
"""

from locust import constant, task

from calculet_load.locust import LLMUser


class Sessions(LLMUser):
    wait_time = constant(1)

    @task
    def session(self):
        chat = self.llm.conversation(shared_prefix_tokens=256, name="chat")
        for _ in range(4):
            if not chat.say(prompt_tokens=64, max_tokens=32).ok:
                break
            self.wait()  # think time between turns: wait_time
