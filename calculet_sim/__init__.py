"""calculet_sim: the simulated Calculet NPU inference service.

The embedded default target of calculet-load: it speaks the OpenAI and llama.cpp
streaming protocols, models NPU timing and scheduling, writes the server and device
traces, and injects the faults of spec §12 through an admin API that is off by default.
"""

__all__: list[str] = []
