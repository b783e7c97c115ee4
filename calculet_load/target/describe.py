"""What a target says about itself, as its profile (schema.profiles) tells where to ask:
its model list, its `/props` (llama.cpp) or version endpoint, its `Server` header.

`discover_model` picks the model to send when the user gave none (OpenAI-style servers
such as vLLM refuse a request naming another model). `describe_target` is what a run
records about a target that is not Calculet (no admin API to ask): never a failure, each
part that could not be read says why.
"""

from __future__ import annotations

import json
from typing import Any

from calculet_load.schema.access import TargetAccess, access_of
from calculet_load.schema.profiles import TargetProfile

# /props of llama.cpp is large (the chat template, every default setting): these keys
# describe the server; the rest stays on the server.
PROPS_KEYS = ("build_info", "model_alias", "model_path", "total_slots", "n_ctx", "modalities")


def _get(access: TargetAccess, path: str, timeout_s: float) -> tuple[int, Any, dict[str, str]]:
    status, raw, headers = access.call("GET", path, None, None, timeout_s)
    try:
        body: Any = json.loads(raw) if raw else None
    except ValueError:
        body = None
    return status, body, headers


def model_ids(body: Any) -> list[str]:
    """The ids of an OpenAI-style model list (`{"data": [{"id": ...}]}`)."""
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list):
        return []
    return [m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]


def discover_model(
    url: str | TargetAccess, profile: TargetProfile, timeout_s: float = 10.0
) -> str | None:
    """The first model the target lists, or None when it lists none (or has no list)."""
    if profile.models_path is None:
        return None
    try:
        status, body, _ = _get(access_of(url), profile.models_path, timeout_s)
    except OSError:
        return None
    ids = model_ids(body) if status == 200 else []
    return ids[0] if ids else None


def model_for(
    url: str | TargetAccess, profile: TargetProfile, protocol: str, given: str | None
) -> str | None:
    """The model name to send: the one given, else (an OpenAI protocol on a server that
    is not Calculet: vLLM refuses any other name) the first one the target lists."""
    if given or protocol == "llama" or profile.name == "calculet":
        return given or None
    return discover_model(url, profile)


def check_health(url: str | TargetAccess, profile: TargetProfile, timeout_s: float = 30.0) -> str:
    """The target's health as its profile reads it ("ok"); raises OSError (unreachable,
    or not healthy, with what it answered). Calculet and llama.cpp answer
    `{"status": "ok"}`, vLLM, SGLang and TGI an empty 200; a plain OpenAI endpoint has
    no health route, so its model list stands in."""
    path = profile.health_probe_path
    status, body, _ = _get(access_of(url), path, timeout_s)
    if status != 200:
        raise OSError(f"GET {path}: HTTP {status}")
    if profile.health_form == "json_status_ok":
        said = body.get("status") if isinstance(body, dict) else None
        if said != "ok":
            raise OSError(f"GET {path}: status {said!r}, not 'ok'")
    return "ok"


def describe_target(
    url: str | TargetAccess, profile: TargetProfile, timeout_s: float = 10.0
) -> dict[str, Any]:
    """The target's own account of itself, for the run folder (no secrets: the access's
    headers are never part of it)."""
    access = access_of(url)
    out: dict[str, Any] = {"profile": profile.name}
    for part, path in (("models", profile.models_path), ("props", profile.props_path)):
        if path is None:
            out[part] = {"available": False, "reason": f"the {profile.name} profile has none"}
            continue
        try:
            status, body, headers = _get(access, path, timeout_s)
        except OSError as exc:
            out[part] = {"available": False, "reason": f"GET {path}: {exc}"}
            continue
        if status != 200:
            out[part] = {"available": False, "reason": f"GET {path}: HTTP {status}"}
            continue
        if part == "models":
            out[part] = {"available": True, "ids": model_ids(body)}
        elif isinstance(body, dict):
            out[part] = {"available": True, **{k: body[k] for k in PROPS_KEYS if k in body}}
            if not any(k in body for k in PROPS_KEYS):
                out[part]["keys"] = sorted(body)[:32]
        else:
            out[part] = {"available": True}
        if "server" in headers:
            out["server_header"] = headers["server"][:200]
    return out
