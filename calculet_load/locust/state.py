"""This process's share of the current Locust run, where the plugin's listeners and the
users find it: its worker (a Locust worker process, or the one local process), the plan
the master fixed, and the master's side (a master or a local process)."""

from __future__ import annotations

from dataclasses import dataclass

from calculet_load.locust.coordinator import Coordinator
from calculet_load.locust.worker import Plan, Worker


@dataclass
class ProcessState:
    worker: Worker | None = None
    plan: Plan | None = None
    master: Coordinator | None = None


STATE = ProcessState()
