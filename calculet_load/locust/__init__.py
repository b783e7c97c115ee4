"""The Locust integration, and the only code that imports Locust: plugin wiring, options,
worker, coordinator, distributed cells, shape, web UI, Prometheus, live statistics, and
the users you program (`LLMUser`).

`from calculet_load.locust import LLMUser` registers the plugin (its options, listeners
and web UI tab) as `locustfiles/calculet.py` does; the package's other modules import
Locust only when asked for, so the rest of calculet-load stays free of its patching.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CalculetUser", "LLMClient", "LLMResult", "LLMStream", "LLMUser", "StreamEvent"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from calculet_load.locust import llmuser, plugin

    return getattr(plugin if name == "CalculetUser" else llmuser, name)
