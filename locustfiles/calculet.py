"""The entry locustfile: `locust -f locustfiles/calculet.py -H http://TARGET ...`.

Importing the plugin registers calculet-load's options (listed in docs/locust.md:
Locust prints `--help` before it loads a locustfile), its listeners, and the web UI's
LLM tab. `CalculetUser` is closed-loop with
`--arrival closed`; with an open-loop or burst arrival the users are idle placeholders
and each process's dispatcher sends. See docs/locust.md.
"""

from calculet_load.locust.plugin import CalculetUser

__all__ = ["CalculetUser"]
