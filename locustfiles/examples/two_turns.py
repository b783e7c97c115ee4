"""Two turns of one chat, the second carrying the first's answer: each turn is measured.

    locust -f locustfiles/examples/two_turns.py --headless -H http://127.0.0.1:8000 \\
        --protocol openai-chat -u 2 -r 2 -t 15s
"""

from locust import constant, task

from calculet_load.locust import LLMUser


class TwoTurns(LLMUser):
    wait_time = constant(0)

    @task
    def talk(self):
        msgs = [{"role": "user", "content": "Tell me about the sea."}]
        first = self.llm.chat(msgs, max_tokens=16, name="turn1")
        msgs += [
            {"role": "assistant", "content": first.text},
            {"role": "user", "content": "And the sky?"},
        ]
        self.llm.chat(msgs, max_tokens=8, name="turn2")
