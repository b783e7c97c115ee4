"""The target a driver runs against: the manifest's `target`, or `--url`'s."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from calculet_load.schema.manifest import RunManifest

__all__ = ["RunTarget"]


@dataclasses.dataclass(frozen=True, slots=True)
class RunTarget:
    """Where the requests go and how they are spoken: `url` (no trailing slash), the
    protocol adapter (`llama` when the manifest names none) and the model name."""

    url: str
    protocol: str
    model: str | None

    @classmethod
    def of(
        cls, manifest: RunManifest, url: str | None, error: Callable[[str], Exception]
    ) -> RunTarget:
        """`--url` over the manifest's `target.url`; `error(message)` is raised when
        neither names one (each driver says it its own way: exit 2 in every one)."""
        target = manifest.target
        found = (url or (target.url if target else "")).rstrip("/")
        if not found:
            raise error("target: no --url and no target.url in the manifest")
        return cls(found, target.protocol if target else "llama", target.model if target else None)
