"""Workload mixes (spec §6.3) as data: weighted request shapes, chosen per arrival.

A mix file is YAML:

    schema: calculet-mix/v1
    name: mixed-70-20-10
    description: 70 % short, 20 % medium, 10 % long
    entries:
      - {name: short, weight: 70, prompt_tokens: 128, max_tokens: 32}
      - {name: medium, weight: 20, prompt_tokens: 2048, max_tokens: 128}
      - {name: long, weight: 10, prompt_tokens: 16384, max_tokens: 256}

The entry for arrival k is a pure function of (seed, k), so every worker agrees on what
the k-th request of the run is, and a rerun with the same seed sends the same sequence.
`--mix` takes a file path or the name of a file in `configs/mixes/`.

An entry of `kind: conversation` is a chat session rather than one request
(calculet_load.workload.conversation): `turns` turns of `prompt_tokens` new user tokens
and `max_tokens` output each, a think time between turns, and a system prompt of
`system_prompt_tokens` that every session shares. Its arrival starts a session: in a
closed loop each user runs one session after the other (the users are the concurrent
sessions), in an open loop the arrivals are the sessions' starts (Poisson session starts
with `--arrival poisson`).
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from calculet_load.configfile import read_yaml, validate

MIX_SCHEMA = "calculet-mix/v1"
MIX_DIR = Path(__file__).resolve().parents[2] / "configs" / "mixes"


class MixError(ValueError):
    pass


class MixEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, description="label; becomes the record's cell")
    weight: float = Field(gt=0, le=1e9, description="relative share of arrivals")
    prompt_tokens: int = Field(ge=1, le=40959, description="exact prompt length in tokens")
    max_tokens: int = Field(ge=1, le=1 << 20, description="output tokens requested (ignore_eos on)")
    stream: bool = True
    temperature: float = Field(default=0.0, ge=0, le=100)
    samples: int = Field(
        default=16,
        ge=1,
        le=1_000_000,
        description="distinct corpus samples cycled through (prefix reuse)",
    )
    kind: Literal["request", "conversation"] = Field(
        default="request", description="one request, or a chat session of `turns` turns"
    )
    turns: int = Field(default=1, ge=1, le=1000, description="conversation: turns per session")
    think_time_s: float = Field(
        default=0.0, ge=0, le=3600, description="conversation: mean pause between two turns"
    )
    think: Literal["constant", "exponential"] = Field(
        default="constant", description="conversation: think times fixed, or drawn with that mean"
    )
    system_prompt_tokens: int = Field(
        default=0,
        ge=0,
        le=40959,
        description="conversation: a system prompt of this many tokens every session shares",
    )

    @model_validator(mode="after")
    def _conversation_fields(self) -> MixEntry:
        if self.kind == "request":
            given = [
                f
                for f, default in (("turns", 1), ("think_time_s", 0.0), ("system_prompt_tokens", 0))
                if getattr(self, f) != default
            ]
            if given:
                raise ValueError(f"{', '.join(given)}: only for an entry of kind conversation")
        elif not self.stream:
            raise ValueError("stream: a conversation's turns are streamed")
        return self


class Mix(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_: Literal["calculet-mix/v1"] = Field(default="calculet-mix/v1", alias="schema")
    name: str = Field(min_length=1)
    description: str = ""
    entries: list[MixEntry] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique_names(self) -> Mix:
        names = [e.name for e in self.entries]
        if len(set(names)) != len(names):
            raise ValueError("entries: names must be unique")
        return self

    def chooser(self, seed: int) -> MixChooser:
        return MixChooser(self, seed)


class MixChooser:
    """entry_for(k): the mix entry of arrival k, from (seed, k) alone."""

    def __init__(self, mix: Mix, seed: int) -> None:
        self.mix = mix
        self.seed = seed
        weights = [e.weight for e in mix.entries]
        total = sum(weights)
        self._cum = [c / total for c in itertools.accumulate(weights)]

    def entry_for(self, k: int) -> tuple[MixEntry, int]:
        """(entry, corpus sample index) of arrival k."""
        if len(self.mix.entries) == 1:
            entry = self.mix.entries[0]
        else:
            digest = hashlib.blake2b(f"{self.seed}:{k}".encode(), digest_size=8).digest()
            u = int.from_bytes(digest, "big") / 2**64
            i = min(bisect.bisect_right(self._cum, u), len(self._cum) - 1)
            entry = self.mix.entries[i]
        return entry, k % entry.samples


def single(prompt_tokens: int, max_tokens: int, *, stream: bool = True) -> Mix:
    """The one-shape mix of `--prompt-tokens`/`--max-tokens`."""
    return Mix(
        name=f"p{prompt_tokens}-o{max_tokens}",
        entries=[
            MixEntry(
                name=f"p{prompt_tokens}-o{max_tokens}",
                weight=1,
                prompt_tokens=prompt_tokens,
                max_tokens=max_tokens,
                stream=stream,
            )
        ],
    )


def parse_mix(data: Any, source: str) -> Mix:
    return validate(Mix, data, source, MixError)


def load_mix(name_or_path: str) -> Mix:
    """A mix from a file path, or by name from configs/mixes/ (`chat-mixed` or its file)."""
    p = Path(name_or_path)
    if not p.exists():
        candidate = MIX_DIR / f"{name_or_path}.yaml"
        if not candidate.exists():
            known = sorted(f.stem for f in MIX_DIR.glob("*.yaml"))
            raise MixError(f"mix: {name_or_path!r} is neither a file nor one of {known}")
        p = candidate
    return parse_mix(read_yaml(p, MixError), str(p))


def mix_json_schema() -> dict[str, Any]:
    return Mix.model_json_schema(by_alias=True)
