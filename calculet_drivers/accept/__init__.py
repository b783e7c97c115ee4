"""The §15 acceptance run: its steps (`pipeline` orders them), the matrix on Locust
workers (`fleet`), interleaved A/B (`interleave`) and the fault matrix as a step."""
