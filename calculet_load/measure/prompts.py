"""Prompts with exact token counts, identified by corpus sample ids, unique per request.

The corpus is synthetic and deterministic: sample `i` of corpus seed `s` is a stream of
pseudo-words drawn from (s, i), so a sample id (`synthetic:s:i`) names the same text on
every host and in every year. A prompt of exactly N tokens is made in one of two ways:

- token ids (OpenAI completions, llama.cpp): the sample's text is tokenized once; the
  prompt is the first N ids of that sample (cycled), so its length is exact by
  construction;
- text (OpenAI chat): words are added or removed until the chat messages tokenize to N,
  template tokens included.

Tokens are counted by the target's own `/tokenize` (with the chat messages where it takes
them, through llama.cpp's `/apply-template` where it does not) or by a local Hugging Face
`tokenizer.json` (`--tokenizer FILE`); which one counted is each prompt's `count_source`.

Unique prompts: a prompt carries a `Nonce`, its first D tokens ("digits"). The session
replaces them per request (`Nonce.apply`), so by default no two requests share a prefix
a server could serve from its cache, and the length stays exact: in ids mode the digits
are token ids of the corpus, in text mode words that are one token each (checked at
build, where a second variant must tokenize to the same count). `unique_from` is where
requests start to differ (0 for ids; after the chat template's fixed prefix for chat).

Only the sample id and the token count are ever recorded; prompt text never leaves this
module (no record, log or report holds it).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from calculet_load.schema.access import TargetAccess, access_of
from calculet_load.schema.profiles import profile_named

MAX_CONTEXT = 40960
_SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "sa", "to", "vi", "be", "do", "fu", "ga")
NONCE_DIGITS = 4  # a prompt's first tokens that differ per request
MAX_ALPHABET = 1024  # distinct first tokens: consecutive requests never share one
MIN_ALPHABET = 8
_MASK64 = (1 << 64) - 1

# A tokenizer takes {"content": text} or {"messages": [...]} and returns the token ids.
Tokenize = Callable[[dict[str, Any]], list[int]]


class WorkloadError(ValueError):
    """A prompt cannot be built as asked (the message names the parameter)."""


def _mix64(x: int) -> int:
    """SplitMix64: a well-mixed 64-bit hash of an integer."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def nonce_salt(*parts: str) -> int:
    """A 64-bit salt from names (run id, worker): different workers' nonces differ."""
    digest = hashlib.blake2b(":".join(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


@dataclasses.dataclass(frozen=True, slots=True)
class Nonce:
    """The first `width` tokens of a prompt, made unique per request.

    Digit 0 is `(seq + salt) mod A` (A = the alphabet's size), so one session's
    consecutive A requests differ at the very first token; the other digits come from a
    hash of (seq, salt), so any two requests share their first `width` tokens with
    probability about A**-width.

    Several processes sending to one server (a run's workers) each take a lane `(i, n)`:
    digit 0 is then `i + n * ((seq + salt) mod (A // n))`, so the processes' first tokens
    never meet, and each one's consecutive A // n requests differ. (With the salt alone
    they met whenever two workers' counts drifted by the salts' difference: a real
    llama-server then served one prompt token from its cache.) Lanes too narrow for that
    (A // n below MIN_ALPHABET) fall back to the salt alone."""

    alphabet: tuple[int, ...] | tuple[str, ...] = dataclasses.field(repr=False)
    width: int

    def digits(self, seq: int, salt: int, lane: tuple[int, int] = (0, 1)) -> list[int]:
        a = len(self.alphabet)
        i, n = lane
        per = a // n
        out = [i + n * ((seq + salt) % per) if per >= MIN_ALPHABET else (seq + salt) % a]
        h = _mix64(salt ^ _mix64(seq))
        for _ in range(self.width - 1):
            h, d = divmod(h, a)
            out.append(d)
        return out

    def apply(
        self, payload: str | list[int], seq: int, salt: int, lane: tuple[int, int] = (0, 1)
    ) -> str | list[int]:
        picked = [self.alphabet[d] for d in self.digits(seq, salt, lane)]
        if isinstance(payload, list):
            return [*picked, *payload[self.width :]]  # type: ignore[list-item]
        words = payload.split(" ", self.width)
        return " ".join([*picked, *words[self.width :]])  # type: ignore[list-item]


@dataclasses.dataclass(frozen=True, slots=True)
class Prompt:
    sample_id: str  # "" for a prompt its caller wrote (`written`)
    tokens: int | None  # None: not counted by the client (the server's count is recorded)
    payload: str | list[int] = dataclasses.field(repr=False)  # never printed or recorded
    count_source: str | None = None  # who counted the tokens (see `Tokenizer.source`)
    nonce: Nonce | None = dataclasses.field(default=None, repr=False)
    unique_from: int | None = None  # the first token that differs between requests

    @classmethod
    def written(cls, payload: str | list[int] = "") -> Prompt:
        """A prompt its caller wrote (text, token ids; chat messages go beside it in the
        request): sent as it is, never made unique, its length left to the server."""
        return cls("", len(payload) if isinstance(payload, list) else None, payload)


def sample_words(seed: int, index: int, count: int) -> list[str]:
    """`count` pseudo-words of corpus sample (seed, index); deterministic everywhere."""
    rng = random.Random(f"calculet-corpus:{seed}:{index}")
    words = []
    for _ in range(count):
        n = rng.randint(1, 3)
        words.append("".join(rng.choice(_SYLLABLES) for _ in range(n)))
    return words


class HttpTokenizer:
    """The target's own `/tokenize`; chat messages either straight to it ("messages") or
    rendered first by llama.cpp's `/apply-template` ("apply-template")."""

    def __init__(
        self, url: str | TargetAccess, *, chat: str = "messages", timeout_s: float = 30.0
    ) -> None:
        if chat not in ("messages", "apply-template"):
            raise WorkloadError(f"chat sizing: expected messages or apply-template, got {chat!r}")
        self.access = access_of(url)  # base path, TLS, headers (schema.access)
        self.url = self.access.url
        self.chat = chat
        self.timeout_s = timeout_s
        self.source = "server:/tokenize"
        self.chat_source = "server:/apply-template+/tokenize" if chat != "messages" else None

    def _post(self, path: str, body: dict[str, Any]) -> Any:
        status, data, _ = self.access.call(
            "POST",
            path,
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
            self.timeout_s,
        )
        if status != 200:
            raise WorkloadError(f"{path}: HTTP {status} from {self.url}")
        try:
            return json.loads(data)
        except ValueError:
            raise WorkloadError(f"{path}: the answer is not JSON") from None

    def __call__(self, body: dict[str, Any]) -> list[int]:
        if "messages" in body and self.chat == "apply-template":
            rendered = self._post("/apply-template", {"messages": body["messages"]})
            prompt = rendered.get("prompt") if isinstance(rendered, dict) else None
            if not isinstance(prompt, str):
                raise WorkloadError("/apply-template: response has no 'prompt' string")
            # what llama.cpp's chat endpoints do with the rendered template
            body = {"content": prompt, "add_special": True, "parse_special": True}
        obj = self._post("/tokenize", body)
        tokens = obj.get("tokens") if isinstance(obj, dict) else None
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise WorkloadError("/tokenize: response has no integer 'tokens' list")
        return tokens


def http_tokenizer(
    url: str | TargetAccess, timeout_s: float = 30.0, *, chat: str = "messages"
) -> Tokenize:
    """POST the body to the target's `/tokenize` and return the token ids."""
    return HttpTokenizer(url, chat=chat, timeout_s=timeout_s)


class LocalTokenizer:
    """A Hugging Face `tokenizer.json` (the `tokenizers` package); chat prompts through
    the `chat_template` of the `tokenizer_config.json` beside it (rendered with jinja2
    as `transformers` does), special tokens in the rendered text parsed as such."""

    def __init__(self, path: str | Path) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise WorkloadError(
                "--tokenizer needs the tokenizers package: pip install 'calculet-load[tokenizer]'"
            ) from None
        path = Path(path)
        try:
            self.tok = Tokenizer.from_file(str(path))
        except Exception as exc:  # the library raises a bare Exception on a bad file
            raise WorkloadError(f"--tokenizer {path}: not a tokenizer.json ({exc})") from None
        self.source = f"local:{path.name}"
        self.template: Any = None
        self.special: dict[str, str] = {}
        config = path.with_name("tokenizer_config.json")
        if config.exists():
            self._load_config(config)

    def _load_config(self, config: Path) -> None:
        import jinja2.sandbox

        try:
            cfg = json.loads(config.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise WorkloadError(f"{config}: cannot read ({exc})") from None
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        for key in ("bos_token", "eos_token"):
            value = cfg.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str):
                self.special[key] = value
        if isinstance(template, str):

            def raise_exception(message: str) -> None:
                raise WorkloadError(f"chat template: {message}")

            env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = raise_exception
            self.template = env.from_string(template)

    def count(self, text: str) -> int:
        """The tokens of a piece of generated text (an event's text, for servers that
        send no per-event count)."""
        return len(self.tok.encode(text, add_special_tokens=False).ids)

    def __call__(self, body: dict[str, Any]) -> list[int]:
        if "messages" in body:
            if self.template is None:
                raise WorkloadError(
                    "--tokenizer: no chat_template in the tokenizer_config.json beside it"
                )
            text = self.template.render(
                messages=body["messages"], add_generation_prompt=True, **self.special
            )
        else:
            text = body.get("content", body.get("prompt"))
            if not isinstance(text, str):
                raise WorkloadError("tokenize: expected a text 'content'")
        ids: list[int] = self.tok.encode(text, add_special_tokens=False).ids
        return ids


def target_tokenizer(
    url: str | TargetAccess, profile: str = "calculet", tokenizer_file: str | Path | None = None
) -> Tokenize:
    """How prompts for this target are sized: a local tokenizer file when one is given,
    else the target's own endpoints as its profile says."""
    if tokenizer_file:
        return LocalTokenizer(tokenizer_file)
    p = profile_named(profile)
    if p.chat_sizing == "local":
        raise WorkloadError(
            f"target profile {p.name}: the server cannot size prompts (no /tokenize); "
            "give --tokenizer FILE (the model's tokenizer.json)"
        )
    return HttpTokenizer(url, chat=p.chat_sizing)


class PromptFactory:
    """Builds exact-length prompts for one target; caches tokenizations per sample."""

    def __init__(
        self,
        tokenize: Tokenize,
        *,
        mode: str,
        corpus_seed: int = 0,
        max_context: int = MAX_CONTEXT,
        count_source: str | None = None,
    ) -> None:
        if mode not in ("ids", "chat"):
            raise WorkloadError(f"mode: expected 'ids' or 'chat', got {mode!r}")
        self.tokenize = tokenize
        default = getattr(tokenize, "source", "tokenize")
        if mode == "chat":
            default = getattr(tokenize, "chat_source", None) or default
        self.count_source = str(count_source or default)
        # a local tokenizer also counts generated text (`Session(count_text=...)`)
        self.count_text: Callable[[str], int] | None = None
        self.mode = mode
        self.corpus_seed = corpus_seed
        self.max_context = max_context
        self._ids: dict[int, list[int]] = {}
        self._chat: dict[tuple[int, int], Prompt] = {}
        self._alphabet: tuple[int, ...] | tuple[str, ...] | None = None

    def sample_id(self, index: int) -> str:
        return f"synthetic:{self.corpus_seed}:{index}"

    def prompt(self, tokens: int, sample: int = 0) -> Prompt:
        if not 1 <= tokens <= self.max_context - 1:
            raise WorkloadError(f"prompt_tokens: {tokens} outside 1..{self.max_context - 1}")
        if self.mode == "ids":
            return self._by_ids(tokens, sample)
        key = (tokens, sample)
        if key not in self._chat:
            self._chat[key] = self._by_text(tokens, sample)
        return self._chat[key]

    def _text_ids(self, text: str) -> list[int]:
        # llama.cpp's /tokenize reads `content`/`add_special`, vLLM's reads
        # `prompt`/`add_special_tokens`; each ignores the other's fields
        body = {"content": text, "add_special": False}
        return self.tokenize(body | {"prompt": text, "add_special_tokens": False})

    def _sample_ids(self, sample: int) -> list[int]:
        ids = self._ids.get(sample)
        if ids is None:
            ids = self._text_ids(" ".join(sample_words(self.corpus_seed, sample, 2048)))
            if not ids:
                raise WorkloadError("/tokenize returned no tokens for the corpus sample")
            self._ids[sample] = ids
        return ids

    def _by_ids(self, tokens: int, sample: int) -> Prompt:
        ids = self._sample_ids(sample)
        if self._alphabet is None:
            distinct = sorted(set(self._sample_ids(0)) | set(ids))
            self._alphabet = tuple(distinct[:MAX_ALPHABET])
        reps = -(-tokens // len(ids))
        nonce = None
        if len(self._alphabet) >= MIN_ALPHABET:
            nonce = Nonce(self._alphabet, min(NONCE_DIGITS, tokens))
        return Prompt(
            self.sample_id(sample),
            tokens,
            (ids * reps)[:tokens],
            count_source=self.count_source,
            nonce=nonce,
            unique_from=0 if nonce is not None else None,
        )

    def _unit_words(self) -> tuple[str, ...]:
        """Words that are one token each, alone and after a space: a nonce made of them
        keeps a text prompt's length exact."""
        if self._alphabet is None:
            found: list[str] = []
            one = [*_SYLLABLES]
            two = ["".join(p) for p in itertools.product(_SYLLABLES, repeat=2)]
            for word in (*one, *two):
                if len(self._text_ids(f"{word} {word}")) == 2:
                    found.append(word)
                    if len(found) == 64:
                        break
            self._alphabet = tuple(found)
        return self._alphabet  # type: ignore[return-value]

    def _by_text(self, tokens: int, sample: int) -> Prompt:
        """Adjust the word count until the chat messages tokenize to exactly `tokens`."""
        alphabet = self._unit_words()
        unique = len(alphabet) >= MIN_ALPHABET
        words = sample_words(self.corpus_seed, sample, tokens)
        n = max(tokens - 8, 1)
        seen: set[int] = set()
        under: tuple[str, int, int] | None = None  # the longest text still short: (text, n, count)

        def made(text: str, ids: list[int], lead: int) -> Prompt:
            return self._checked(sample, tokens, text, ids, Nonce(alphabet, lead) if lead else None)

        for _ in range(32):
            lead = min(NONCE_DIGITS, n) if unique else 0
            body = self._extend(words, n - lead, sample)
            text = " ".join([*alphabet[:lead], *body])
            ids = self._chat_ids(text)
            if len(ids) == tokens:
                return made(text, ids, lead)
            if len(ids) < tokens and (under is None or n > under[1]):
                under = (text, n, len(ids))
            if n in seen or (len(ids) > tokens and n == 1):
                break
            seen.add(n)
            n = max(n + (tokens - len(ids)), 1)
        if under is not None and alphabet:
            # words of several tokens step over the length: pad with one-token words
            text, n, count = under
            pad = [alphabet[i % len(alphabet)] for i in range(tokens - count)]
            text = " ".join([text, *pad])
            ids = self._chat_ids(text)
            if len(ids) == tokens:
                return made(text, ids, min(NONCE_DIGITS, n) if unique else 0)
        raise WorkloadError(
            f"prompt_tokens: cannot make a chat prompt of exactly {tokens} tokens "
            f"(the chat template alone may be longer)"
        )

    def _chat_ids(self, text: str) -> list[int]:
        return self.tokenize({"messages": [{"role": "user", "content": text}]})

    def _checked(
        self, sample: int, tokens: int, text: str, ids: Sequence[int], nonce: Nonce | None
    ) -> Prompt:
        """The prompt, once a request's variant is seen to keep the exact length."""
        unique_from = None
        if nonce is not None:
            other = self._chat_ids(str(nonce.apply(text, 1, 0)))
            if len(other) != tokens:
                raise WorkloadError(
                    f"prompt_tokens: a unique variant of the {tokens}-token chat prompt "
                    f"tokenizes to {len(other)}; use --prompt-reuse with this tokenizer"
                )
            unique_from = next(
                (i for i, (a, b) in enumerate(zip(ids, other, strict=True)) if a != b), tokens
            )
        return Prompt(
            self.sample_id(sample),
            tokens,
            text,
            count_source=self.count_source,
            nonce=nonce,
            unique_from=unique_from,
        )

    def _extend(self, words: list[str], n: int, sample: int) -> list[str]:
        if n > len(words):
            words.extend(sample_words(self.corpus_seed, sample + 1_000_003, n - len(words)))
        return words[:n]


def target_prompts(
    url: str | TargetAccess,
    protocol: str,
    target: Any = None,
    *,
    off_loop: Callable[[Callable[[], list[int]]], list[int]] | None = None,
) -> PromptFactory:
    """The prompt factory of a driver: sized as the manifest's `target` (a
    `schema.manifest.Target`: profile, tokenizer) says; `off_loop` runs each tokenization
    off the gevent loop (the drivers pass `target.api.off_loop`)."""
    tokenize = target_tokenizer(
        url,
        getattr(target, "profile", None) or "calculet",
        getattr(target, "tokenizer", None),
    )
    call = tokenize
    if off_loop is not None:
        run = off_loop

        def call(body: dict[str, Any]) -> list[int]:
            return run(lambda: tokenize(body))

    factory = PromptFactory(
        call,
        mode="chat" if protocol == "openai-chat" else "ids",
        count_source=getattr(
            tokenize, "chat_source" if protocol == "openai-chat" else "source", None
        ),
    )
    if isinstance(tokenize, LocalTokenizer):
        factory.count_text = tokenize.count
    return factory


class PromptBook:
    """A target's exact-length prompts for every protocol a run speaks, each built once:
    one factory per protocol (`make(protocol)`: chat text for `openai-chat`, token ids
    otherwise), made when first asked for; `given` holds factories already made."""

    def __init__(
        self,
        make: Callable[[str], PromptFactory],
        given: dict[str, PromptFactory] | None = None,
    ) -> None:
        self._make = make
        self._factories: dict[str, PromptFactory] = dict(given or {})
        self._prompts: dict[tuple[str, int, int], Prompt] = {}

    def factory(self, protocol: str) -> PromptFactory:
        if protocol not in self._factories:
            self._factories[protocol] = self._make(protocol)
        return self._factories[protocol]

    def __len__(self) -> int:  # how many prompts are built
        return len(self._prompts)

    def __call__(self, protocol: str, tokens: int, sample: int) -> Prompt:
        """The prompt of exactly `tokens` tokens from corpus sample `sample`."""
        key = (protocol, tokens, sample)
        found = self._prompts.get(key)
        if found is None:
            found = self._prompts[key] = self.factory(protocol).prompt(tokens, sample)
        return found
