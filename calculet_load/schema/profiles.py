"""Target profiles as data: what each kind of inference server exposes and how to use it.

A profile says where the server's health answer is and what it looks like, whether it
lists models, how a prompt is sized (its own `/tokenize`, with chat messages or through
llama.cpp's `/apply-template`, or only with a local tokenizer file), which usage options
it honours, where it reports prompt tokens served from its prefix cache, and which of
Calculet's own endpoints (admin API, traces, device telemetry) it has. Drivers ask the
profile instead of assuming a Calculet server; a step that needs what the target lacks
is `not_available`, never a failure of the target.

Pure data: no I/O. `calculet_load.measure.prompts` and `calculet_load.target` read it.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

ProfileName = Literal["calculet", "llama.cpp", "vllm", "sglang", "tgi", "openai"]
HealthForm = Literal["json_status_ok", "empty_200", "models"]
# How a prompt is sized: "messages" = POST /tokenize {"messages": ...} counts the chat
# template too; "apply-template" = llama.cpp: POST /apply-template renders the template,
# POST /tokenize {"content", "parse_special": true} counts it; "local" = only a
# tokenizer file the user gives (`--tokenizer`), the server has no /tokenize.
ChatSizing = Literal["messages", "apply-template", "local"]
TextSizing = Literal["tokenize", "local"]


@dataclasses.dataclass(frozen=True, slots=True)
class TargetProfile:
    name: ProfileName
    description: str
    health_path: str | None  # GET; None: the model list stands in for health
    health_form: HealthForm
    models_path: str | None  # an OpenAI-style model list (discovery when --model is absent)
    text_sizing: TextSizing
    chat_sizing: ChatSizing
    continuous_usage: bool  # honours stream_options.continuous_usage_stats (per-event usage)
    cached_tokens_field: str | None  # where it reports prompt tokens served from cache
    props_path: str | None  # a GET that describes the server (recorded at release)
    admin_api: bool  # Calculet's admin/fault API (/admin/...)
    traces: bool  # server/runtime traces (/admin/traces)
    metrics: bool  # Prometheus metrics at /metrics (sampled into server/ during a run)
    device_telemetry: bool  # chip gauges on /metrics
    cache_off: str  # how a user turns server-side prefix caching off (cold prefills)

    @property
    def health_probe_path(self) -> str:
        """What a health check GETs: the health path, else the model list, else /."""
        return self.health_path or self.models_path or "/"


PROFILES: dict[str, TargetProfile] = {
    p.name: p
    for p in (
        TargetProfile(
            name="calculet",
            description="the Calculet inference service (and calculet-sim)",
            health_path="/health",
            health_form="json_status_ok",
            models_path="/v1/models",
            text_sizing="tokenize",
            chat_sizing="messages",
            continuous_usage=True,
            cached_tokens_field="timings.cache_n",
            props_path=None,
            admin_api=True,
            traces=True,
            metrics=True,
            device_telemetry=True,
            cache_off="no prefix cache on the Calculet service",
        ),
        TargetProfile(
            name="llama.cpp",
            description="llama.cpp llama-server",
            health_path="/health",
            health_form="json_status_ok",
            models_path="/v1/models",
            text_sizing="tokenize",
            chat_sizing="apply-template",
            continuous_usage=False,
            cached_tokens_field="timings.cache_n",
            props_path="/props",
            admin_api=False,
            traces=False,
            metrics=True,
            device_telemetry=False,
            cache_off=(
                "the llama protocol sends cache_prompt: false; the OpenAI endpoints cache "
                "prompts by default, so rely on unique prompts (the default)"
            ),
        ),
        TargetProfile(
            name="vllm",
            description="vLLM's OpenAI-compatible server",
            health_path="/health",
            health_form="empty_200",
            models_path="/v1/models",
            text_sizing="tokenize",
            chat_sizing="messages",
            continuous_usage=True,
            cached_tokens_field="usage.prompt_tokens_details.cached_tokens",
            props_path="/version",
            admin_api=False,
            traces=False,
            metrics=True,
            device_telemetry=False,
            cache_off="start vllm serve with --no-enable-prefix-caching",
        ),
        TargetProfile(
            name="sglang",
            description="SGLang's OpenAI-compatible server",
            health_path="/health",
            health_form="empty_200",
            models_path="/v1/models",
            text_sizing="local",
            chat_sizing="local",
            continuous_usage=True,
            cached_tokens_field="usage.prompt_tokens_details.cached_tokens",
            props_path="/get_model_info",
            admin_api=False,
            traces=False,
            metrics=True,
            device_telemetry=False,
            cache_off="start sglang with --disable-radix-cache",
        ),
        TargetProfile(
            name="tgi",
            description="Hugging Face text-generation-inference (Messages API)",
            health_path="/health",
            health_form="empty_200",
            models_path="/v1/models",
            text_sizing="local",
            chat_sizing="local",
            continuous_usage=False,
            cached_tokens_field=None,
            props_path="/info",
            admin_api=False,
            traces=False,
            metrics=True,
            device_telemetry=False,
            cache_off="start TGI with PREFIX_CACHING=0 in its environment",
        ),
        TargetProfile(
            name="openai",
            description="any OpenAI-compatible endpoint or gateway",
            health_path=None,
            health_form="models",
            models_path="/v1/models",
            text_sizing="local",
            chat_sizing="local",
            continuous_usage=False,
            cached_tokens_field="usage.prompt_tokens_details.cached_tokens",
            props_path=None,
            admin_api=False,
            traces=False,
            metrics=False,
            device_telemetry=False,
            cache_off="ask the provider; unique prompts (the default) defeat prefix caches",
        ),
    )
}
PROFILE_NAMES: tuple[str, ...] = tuple(PROFILES)


def profile_named(name: str) -> TargetProfile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(
            f"target profile: unknown {name!r}; one of {', '.join(PROFILE_NAMES)}"
        ) from None
