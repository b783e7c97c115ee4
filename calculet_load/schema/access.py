"""How to reach a target: scheme, TLS, base path, headers and the API key, declared once.

Every part of the harness that talks to a target (the timed client, the target's
health/admin/metrics/trace endpoints, `/tokenize`, the RTT probe) resolves its paths and
headers through one `TargetAccess`, and every entry point (probe, the Locust plugin,
accept, soak, faults, capacity) builds it from the same options (`ACCESS_OPTIONS`) or
the manifest's `target` section.

**Base paths.** The URL may carry a path: `https://gw.example/llm/v1` or
`http://127.0.0.1:8443/llm`. The harness's own paths are written from the server's root
(`/v1/chat/completions`, `/completion`, `/health`, `/tokenize`, `/metrics`,
`/admin/state`, `/traces/server`). A base path ending in `/v1` is read as an OpenAI-style
API root, as the OpenAI SDKs' `base_url` is: its `/v1` is dropped to find the server's
root, so `…/llm/v1` + `/v1/completions` is `/llm/v1/completions` (never `/v1/v1`) and
`…/llm/v1` + `/health` is `/llm/health`. Any other base path is a plain prefix:
`…/llm` + `/v1/completions` is `/llm/v1/completions`.

**Secrets.** The API key (from a file or an environment variable) is sent as
`Authorization: Bearer <key>`; it and every header value whose name looks secret
(Authorization, Cookie, anything with key, token, secret or password in its name) are
kept out of `repr` and replaced by `<redacted>` in `describe()`, the only form that is
written anywhere (manifest copies, the client index, plans, logs, reports).

**Distributed runs.** Secrets never travel between hosts: a distributed `accept` sends
its workers the description only, and each worker rebuilds the access on its own host
(`access_described`): the API key from the same file or variable there, a secret header
from the worker's own `--header`.
"""

from __future__ import annotations

import dataclasses
import http.client
import os
import re
import ssl
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

REDACTED = "<redacted>"
_SECRET_NAME = re.compile(r"authorization|cookie|key|token|secret|passw", re.IGNORECASE)
_HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")  # an RFC 9110 token
_DEFAULT_PORT = {"http": 80, "https": 443}


class AccessError(ValueError):
    """The target's address or credentials are unusable; `str()` is one line."""


def secret_header(name: str) -> bool:
    """Whether a header's value must never be written anywhere."""
    return bool(_SECRET_NAME.search(name))


def parse_header(text: str) -> tuple[str, str]:
    """`'K: V'` (or `'K:V'`) as (name, value); AccessError when it is not a header."""
    name, sep, value = text.partition(":")
    name, value = name.strip(), value.strip()
    if not sep or not _HEADER_NAME.match(name):
        raise AccessError(f"--header {name or text[:20]!r}...: expected 'Name: value'")
    if "\r" in value or "\n" in value:
        raise AccessError(f"--header {name}: the value has a line break")
    return name, value


def read_api_key(file: str | None = None, env: str | None = None) -> str | None:
    """The API key from a file (its first line, stripped) or an environment variable."""
    if file and env:
        raise AccessError("give --api-key-file or --api-key-env, not both")
    if file:
        try:
            text = Path(file).read_text(encoding="utf-8")
        except OSError as exc:
            raise AccessError(f"--api-key-file {file}: {exc.strerror}") from None
        key = (text.strip().splitlines() or [""])[0].strip()
        if not key:
            raise AccessError(f"--api-key-file {file}: the file is empty")
        return key
    if env:
        key = os.environ.get(env, "").strip()
        if not key:
            raise AccessError(f"--api-key-env {env}: the variable is not set or empty")
        return key
    return None


@dataclasses.dataclass(frozen=True)
class TargetAccess:
    """A target's address and credentials (see the module's docstring)."""

    url: str
    ca_file: str | None = None
    insecure: bool = False
    headers: tuple[tuple[str, str], ...] = dataclasses.field(default=(), repr=False)
    api_key_file: str | None = None
    api_key_env: str | None = None
    _key: str | None = dataclasses.field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        if parts.scheme not in _DEFAULT_PORT or not parts.hostname:
            raise AccessError(f"target url {self.url!r}: expected http(s)://HOST[:PORT][/PATH]")
        if parts.username is not None or parts.password is not None:
            raise AccessError(
                "target url: credentials in the URL would be written with it; "
                "use --api-key-file, --api-key-env or --header instead"
            )
        if parts.query or parts.fragment:
            raise AccessError(f"target url {self.url!r}: no query or fragment, a base path only")
        if self.insecure and self.ca_file:
            raise AccessError("give --ca-file or --insecure, not both")
        if self.scheme == "http" and (self.insecure or self.ca_file):
            raise AccessError("--ca-file and --insecure apply to an https:// target only")
        for name, _ in self.headers:
            if name.lower() in ("host", "content-length", "transfer-encoding"):
                raise AccessError(f"--header {name}: set by the client, not by a header")
        if self._key is None:
            key = read_api_key(self.api_key_file, self.api_key_env)
            object.__setattr__(self, "_key", key)

    # --- the address -----------------------------------------------------------------
    @property
    def scheme(self) -> str:
        return urlsplit(self.url).scheme

    @property
    def host(self) -> str:
        return urlsplit(self.url).hostname or ""

    @property
    def port(self) -> int:
        return urlsplit(self.url).port or _DEFAULT_PORT[self.scheme]

    @property
    def tls(self) -> bool:
        return self.scheme == "https"

    @property
    def authority(self) -> str:
        """The Host header: the port only when it is not the scheme's default."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        port = urlsplit(self.url).port
        return host if port in (None, _DEFAULT_PORT[self.scheme]) else f"{host}:{port}"

    @property
    def root(self) -> str:
        """The server's root under the base path ('' or '/prefix', no trailing slash)."""
        base = urlsplit(self.url).path.rstrip("/")
        return base[: -len("/v1")] if base.endswith("/v1") else base

    @property
    def origin(self) -> str:
        """scheme://authority of the URL (no path)."""
        return f"{self.scheme}://{self.authority}"

    def path(self, path: str) -> str:
        """A server path (from its root, with a leading /) under the base path."""
        if not path.startswith("/"):
            path = "/" + path
        return self.root + path

    def resolve(self, path: str) -> str:
        """The full URL of a server path (for messages and urllib)."""
        return self.origin + self.path(path)

    # --- TLS --------------------------------------------------------------------------
    def ssl_context(
        self, create: Callable[..., ssl.SSLContext] = ssl.create_default_context
    ) -> ssl.SSLContext | None:
        """None for http://; verification on with the system CAs (or --ca-file), off only
        with --insecure. `create` is ssl's create_default_context or gevent.ssl's."""
        if not self.tls:
            return None
        try:
            ctx = create(cafile=self.ca_file)
        except (OSError, ssl.SSLError) as exc:
            raise AccessError(f"--ca-file {self.ca_file}: {exc}") from None
        if self.insecure:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        return ctx

    # --- headers ----------------------------------------------------------------------
    def request_headers(self) -> list[tuple[str, str]]:
        """The headers every request carries: --header's, then the API key's."""
        out = list(self.headers)
        if self._key is not None and not any(n.lower() == "authorization" for n, _ in out):
            out.append(("Authorization", f"Bearer {self._key}"))
        return out

    def secrets(self) -> list[str]:
        """Every secret value this access sends (for tests and scrubbing, never to write)."""
        out = [v for n, v in self.headers if secret_header(n) and v]
        if self._key is not None:
            out.append(self._key)
        return out

    def describe(self) -> dict[str, Any]:
        """What may be written: secrets as `<redacted>`, the key by its source only."""
        return {
            "url": self.url,
            "tls": self.tls,
            "ca_file": self.ca_file,
            "insecure": self.insecure,
            "headers": {n: REDACTED if secret_header(n) else v for n, v in self.headers},
            "api_key": (
                {"file": self.api_key_file}
                if self.api_key_file
                else {"env": self.api_key_env}
                if self.api_key_env
                else None
            ),
        }

    def banner(self) -> str | None:
        """A line to show prominently when verification is off, else None."""
        if self.insecure:
            return f"INSECURE: TLS certificate verification is off for {self.url} (--insecure)"
        return None

    # --- blocking calls (http.client): the target's non-generation endpoints ----------
    def connection(self, timeout_s: float) -> http.client.HTTPConnection:
        if self.tls:
            return http.client.HTTPSConnection(
                self.host, self.port, timeout=timeout_s, context=self.ssl_context()
            )
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout_s)

    def call(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        timeout_s: float = 30.0,
        on_sent: Callable[[], None] | None = None,
    ) -> tuple[int, bytes, dict[str, str]]:
        """(status, body, lower-cased headers) of one blocking call to a server path;
        `headers` add to (and override) the access's own. Raises OSError (ssl.SSLError
        included) when the target cannot be reached."""
        merged = {n: v for n, v in self.request_headers()}
        for name, value in (headers or {}).items():
            for old in [n for n in merged if n.lower() == name.lower()]:
                del merged[old]
            merged[name] = value
        conn = self.connection(timeout_s)
        try:
            conn.request(method, self.path(path), body=body, headers=merged)
            if on_sent is not None:
                on_sent()
            resp = conn.getresponse()
            raw = resp.read()
            return resp.status, raw, {k.lower(): v for k, v in resp.getheaders()}
        finally:
            conn.close()

    def with_url(self, url: str) -> TargetAccess:
        """The same credentials and TLS settings for another URL (e.g. a metrics port)."""
        return dataclasses.replace(self, url=url)


def access_of(url: str | TargetAccess) -> TargetAccess:
    """A bare URL (tests, old callers) as an access without credentials."""
    return url if isinstance(url, TargetAccess) else TargetAccess(url.rstrip("/") or url)


# ------------------------------------------------------------------ the options, once
# (flags, argparse keywords): probe, the Locust plugin, accept, soak, faults, capacity.
# None of them shows in Locust's web UI (secrets and paths stay on the command line).
ACCESS_OPTIONS: list[tuple[tuple[str, ...], dict[str, Any]]] = [
    (
        ("--ca-file",),
        dict(default=None, help="https: verify the target's certificate against this CA file"),
    ),
    (
        ("--insecure",),
        dict(
            action="store_true",
            default=False,
            help="https: do NOT verify the target's certificate (shown in the index and report)",
        ),
    ),
    (
        ("--header",),
        dict(
            action="append",
            default=None,
            metavar="'NAME: VALUE'",
            help="a header sent with every request to the target (repeatable); values of "
            "secret-looking names (Authorization, *key*, *token*) are never written",
        ),
    ),
    (
        ("--api-key-file",),
        dict(default=None, help="send 'Authorization: Bearer <first line of FILE>'"),
    ),
    (
        ("--api-key-env",),
        dict(default=None, metavar="NAME", help="send 'Authorization: Bearer $NAME'"),
    ),
]


def add_access_arguments(add: Callable[..., Any]) -> None:
    """Register the access options with `add` (argparse's add_argument, or Locust's)."""
    for flags, kw in ACCESS_OPTIONS:
        add(*flags, **kw)


def access_from(args: Any, url: str, target: Any = None) -> TargetAccess:
    """The access of parsed options over the manifest's `target` section (a
    schema.manifest.Target or None): an option given on the command line wins."""

    def pick(name: str) -> Any:
        value = getattr(args, name, None)
        if value not in (None, "", False, []):
            return value
        return getattr(target, name, None) if target is not None else None

    header_lines = list(getattr(target, "headers", None) or []) + list(
        getattr(args, "header", None) or []
    )
    key_file, key_env = getattr(args, "api_key_file", None), getattr(args, "api_key_env", None)
    if not key_file and not key_env and target is not None:
        key_file, key_env = target.api_key_file, target.api_key_env
    return TargetAccess(
        url.rstrip("/"),
        ca_file=pick("ca_file"),
        insecure=bool(pick("insecure")),
        headers=tuple(parse_header(h) for h in header_lines),
        api_key_file=key_file or None,
        api_key_env=key_env or None,
    )


def access_described(desc: Mapping[str, Any], args: Any = None) -> TargetAccess:
    """The access a `describe()` stands for, rebuilt on this host (a distributed run's
    worker): the API key from the same file or variable here, and this host's own
    access options (`args`, parsed) over the description. A secret header is redacted
    in the description, so this host must give it with its own --header; AccessError
    names it otherwise."""
    own = dict(parse_header(h) for h in (getattr(args, "header", None) or []))
    own_names = {n.lower() for n in own}
    headers = [(n, v) for n, v in (desc.get("headers") or {}).items() if n.lower() not in own_names]
    for name, value in headers:
        if value == REDACTED:
            raise AccessError(
                f"header {name}: its value is secret and is not sent to workers; "
                f"start this worker with --header '{name}: ...'"
            )
    key = desc.get("api_key") or {}
    key_file = getattr(args, "api_key_file", None) or None
    key_env = getattr(args, "api_key_env", None) or None
    if not key_file and not key_env:
        key_file, key_env = key.get("file"), key.get("env")
    return TargetAccess(
        str(desc["url"]),
        ca_file=getattr(args, "ca_file", None) or desc.get("ca_file"),
        insecure=bool(getattr(args, "insecure", False) or desc.get("insecure")),
        headers=tuple(headers) + tuple(own.items()),
        api_key_file=key_file,
        api_key_env=key_env,
    )
