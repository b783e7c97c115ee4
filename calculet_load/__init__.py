"""calculet-load: a Locust-based load generator and acceptance harness for LLM inference
services on Calculet NPUs.

Importing this package imports neither Locust nor gevent (the analysis depends on that).
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
