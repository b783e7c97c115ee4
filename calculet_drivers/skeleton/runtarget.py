"""The target a driver runs against: the manifest's `target`, or `--url`'s."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from calculet_load.errors import EXIT_INFRA, EXIT_INVALID, RunStop
from calculet_load.measure.preflight import preflight
from calculet_load.schema.access import AccessError, TargetAccess, access_from
from calculet_load.schema.manifest import RunManifest
from calculet_load.schema.profiles import TargetProfile, profile_named
from calculet_load.target.api import TargetAPI, off_loop
from calculet_load.target.describe import check_health, model_for

__all__ = ["Capability", "RunTarget"]

# what a target may not have: its profile says (schema.profiles)
Capability = Literal["admin API", "traces", "device telemetry"]


@dataclasses.dataclass(frozen=True, slots=True)
class RunTarget:
    """Where the requests go and how they are spoken: `url` (no trailing slash), the
    protocol adapter (`llama` when the manifest names none) and the model name (the
    manifest's, else the first the target lists: target.describe.model_for); `access`,
    how it is reached (TLS, base path, headers, API key: calculet_load.schema.access)."""

    url: str
    protocol: str
    model: str | None
    access: TargetAccess
    profile: TargetProfile  # what kind of server it is (schema.profiles)

    @classmethod
    def of(cls, manifest: RunManifest, url: str | None) -> RunTarget:
        """`--url` over the manifest's `target.url`; RunStop (exit 2) when neither names
        one, or its access is unusable."""
        target = manifest.target
        found = (url or (target.url if target else "")).rstrip("/")
        if not found:
            raise RunStop(EXIT_INVALID, "target: no --url and no target.url in the manifest")
        try:
            access = access_from(None, found, target)
        except AccessError as exc:
            raise RunStop(EXIT_INVALID, f"target: {exc}") from None
        protocol = target.protocol if target else "llama"
        profile = profile_named(target.profile if target else "calculet")
        model = model_for(access, profile, protocol, target.model if target else None)
        return cls(found, protocol, model, access, profile)

    def api(self, admin_token: str | None, operator: str, **kw: Any) -> TargetAPI:
        """The target's admin, health, metrics and trace endpoints, through its access."""
        return TargetAPI(self.access, admin_token, operator=operator, **kw)

    def lacks(self, what: Capability) -> str | None:
        """Why the target cannot give `what` (its profile says it has none), or None."""
        p = self.profile
        has = {"admin API": p.admin_api, "traces": p.traces, "device telemetry": p.device_telemetry}
        return None if has[what] else f"the {p.name} target has no {what}"

    def check(self) -> str | None:
        """Before a driver's load: the target answers its health check as its profile
        reads it (a target just started gets a few seconds) and one streamed request of
        the run's protocol (measure.preflight). None, or the one line saying what is
        wrong with it. Call it on the gevent loop."""
        try:
            off_loop(lambda: check_health(self.access, self.profile))
        except OSError as exc:
            path = self.profile.health_probe_path
            return f"target {self.url} failed its health check (GET {path}): {exc}"
        return preflight(self.access, self.protocol, self.model).problem

    def require(self, context: str = "") -> None:
        """`check`, and RunStop (exit 3: infrastructure) when the target fails it."""
        problem = self.check()
        if problem is not None:
            raise RunStop(EXIT_INFRA, f"{context}{problem}")
