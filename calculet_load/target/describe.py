"""What a target says about itself, as its profile (schema.profiles) tells where to ask:
its model list, its `/props` (llama.cpp) or version endpoint, its `Server` header.

`discover_model` picks the model to send when the user gave none (OpenAI-style servers
such as vLLM refuse a request naming another model). `describe_target` is what a run
records about a target that is not Calculet (no admin API to ask): never a failure, each
part that could not be read says why.
"""

from __future__ import annotations

import json
import time
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


def check_health(
    url: str | TargetAccess,
    profile: TargetProfile,
    timeout_s: float = 30.0,
    starting_s: float = 5.0,
) -> str:
    """The target's health as its profile reads it ("ok"); raises OSError (unreachable,
    or not healthy, with what it answered). Calculet and llama.cpp answer
    `{"status": "ok"}`, vLLM, SGLang and TGI an empty 200; a plain OpenAI endpoint has
    no health route, so its model list stands in. A target that refuses the connection
    is asked again for `starting_s`: one started beside the run may not listen yet."""
    path = profile.health_probe_path
    deadline = time.monotonic() + starting_s
    while True:
        try:
            status, body, _ = _get(access_of(url), path, timeout_s)
            break
        except ConnectionRefusedError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.25)
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


# Who a `/v1/models` entry's `owned_by` names, as these servers write it
_OWNERS = (
    ("calculet", "calculet"),
    ("llamacpp", "llama.cpp"),
    ("llama.cpp", "llama.cpp"),
    ("vllm", "vllm"),
    ("sglang", "sglang"),
    ("tgi", "tgi"),
    ("text-generation-inference", "tgi"),
)


class DetectError(OSError):
    """The target could not be asked what it is (it did not answer at all)."""


def detect_profile(url: str | TargetAccess, timeout_s: float = 5.0) -> tuple[str, str]:
    """What kind of server the target is (a profile name of schema.profiles) and the
    evidence, asked the way each names itself: llama.cpp's `/props`, vLLM's `/version`,
    SGLang's `/get_server_info`, TGI's `/info`, the `owned_by` of its `/v1/models`, and
    the Calculet service's `/health` (its `state`). A server that answers `/v1/models` and
    names no one is an OpenAI-compatible one (`openai`). Raises LookupError when nothing
    tells (naming what was asked), DetectError when the target answers nothing."""
    access = access_of(url)
    answered = False
    asked = []

    def get(path: str) -> tuple[int, Any, dict[str, str]]:
        nonlocal answered
        asked.append(path)
        try:
            found = _get(access, path, timeout_s)
        except OSError:
            return 0, None, {}
        answered = True
        return found

    status, body, headers = get("/v1/models")
    owners = []
    if status == 200 and isinstance(body, dict) and isinstance(body.get("data"), list):
        owners = [str(m.get("owned_by", "")).lower() for m in body["data"] if isinstance(m, dict)]
    for owner in owners:
        for mark, name in _OWNERS:
            if mark in owner:
                return name, f"/v1/models: owned_by {owner!r}"
    s, props, _ = get("/props")
    if s == 200 and isinstance(props, dict) and ("build_info" in props or "total_slots" in props):
        return "llama.cpp", "/props: llama.cpp's settings (build_info, total_slots)"
    if "llama.cpp" in headers.get("server", "").lower():
        return "llama.cpp", f"Server: {headers['server'][:80]}"
    s, info, _ = get("/get_server_info")
    if s == 200 and isinstance(info, dict) and ("tokenizer_path" in info or "version" in info):
        return "sglang", "/get_server_info answered (SGLang's)"
    s, info, _ = get("/info")
    if s == 200 and isinstance(info, dict) and "model_id" in info and "router" in info:
        return "tgi", "/info: model_id and router (TGI's)"
    s, version, _ = get("/version")
    if s == 200 and isinstance(version, dict) and set(version) == {"version"}:
        return "vllm", f"/version: {version['version']!r} (vLLM's)"
    s, health, _ = get("/health")
    if s == 200 and isinstance(health, dict) and "state" in health and "status" in health:
        return "calculet", "/health: status and state (the Calculet service's)"
    if owners or status == 200:
        return "openai", "/v1/models answered and names no server it knows"
    if not answered:
        raise DetectError(f"the target answered none of {', '.join(asked)}")
    raise LookupError(f"nothing the target answered ({', '.join(asked)}) names its kind")
