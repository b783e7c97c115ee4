"""Fields of your own in the request body: tool definitions and a JSON-schema
`response_format`, passed through `**body` as they are.

    locust -f locustfiles/examples/tools_user.py --headless -H http://127.0.0.1:8000 \\
        -u 2 -r 2 -t 30s
"""

from locust import constant, task

from calculet_load.locust import LLMUser

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather at a place",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
ANSWER = {
    "type": "json_schema",
    "json_schema": {
        "name": "answer",
        "schema": {"type": "object", "properties": {"text": {"type": "string"}}},
    },
}


class Tools(LLMUser):
    wait_time = constant(0.5)

    @task
    def ask(self):
        msgs = [{"role": "user", "content": "What is the weather in Oslo?"}]
        self.llm.chat(msgs, max_tokens=24, name="tools", tools=[WEATHER], tool_choice="auto")
        self.llm.chat(msgs, max_tokens=24, name="json", response_format=ANSWER)
