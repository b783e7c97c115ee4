"""A real llama.cpp `llama-server` for tests: built from the source PyPI ships, cached
outside the clone, serving a tiny random-weight Qwen2 model with the real Qwen2 vocabulary.

- Source: the `llama-cpp-python` sdist (pinned version and SHA-256), whose `vendor/llama.cpp`
  is a complete llama.cpp tree. Only the `llama-server` target is built (CPU, no network
  features, no web UI), with cmake, once per machine: the binary lives under
  `$CALCULET_CACHE` (default `~/.cache/calculet-load`) in a folder named by the sdist's
  hash, so only the first run on a machine pays for the build (about 9 min on 2 cores).
- Model: made with the `gguf` package from the tree's own `models/ggml-vocab-qwen2.gguf`
  (tokenizer, merges, chat template: the real Qwen2 ones) and small random weights, so
  generation is fast on a CPU and its tokens are arbitrary (partial UTF-8 characters
  included), which is what a client's counting must survive.

`python -m tests.support.llamacpp` does the set-up (scripts/test runs it before the suite) and
prints the binary's and the model's paths.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from pathlib import Path

SDIST_NAME = "llama-cpp-python"
SDIST_VERSION = "0.3.36"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
VOCAB = "models/ggml-vocab-qwen2.gguf"
MODEL_NAME = "tiny-qwen2-random"

# The model's shape: small enough for a CPU to serve quickly, long enough a context for
# the spec's 40,960-token prompts.
N_EMBD, N_LAYER, N_HEAD, N_HEAD_KV, N_FF = 64, 2, 4, 2, 128
N_CTX = 40960
MODEL_SEED = 20261204


def cache_root() -> Path:
    root = os.environ.get("CALCULET_CACHE") or Path.home() / ".cache" / "calculet-load"
    return Path(root)


def build_dir() -> Path:
    return cache_root() / f"llama-server-{SDIST_SHA256[:16]}"


def server_binary() -> Path:
    return build_dir() / "llama-server"


def model_path() -> Path:
    return build_dir() / f"{MODEL_NAME}-{_model_key()}.gguf"


def _model_key() -> str:
    shape = f"{N_EMBD}.{N_LAYER}.{N_HEAD}.{N_HEAD_KV}.{N_FF}.{N_CTX}.{MODEL_SEED}.untied"
    return hashlib.sha256(shape.encode()).hexdigest()[:12]


def _log(msg: str) -> None:
    print(f"tests.support.llamacpp: {msg}", file=sys.stderr, flush=True)


def _fetch_sdist(dest: Path) -> Path:
    """Download the pinned sdist with pip (its index settings apply) and check its hash."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--no-deps",
            "--no-binary",
            ":all:",
            "--dest",
            str(dest),
            f"{SDIST_NAME}=={SDIST_VERSION}",
        ],
        check=True,
    )
    (sdist,) = dest.glob("llama_cpp_python-*.tar.gz")
    digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        raise RuntimeError(f"{sdist.name}: SHA-256 {digest}, expected {SDIST_SHA256}")
    return sdist


def ensure_source(work: Path) -> Path:
    """The vendored llama.cpp tree of the pinned sdist, unpacked under `work`."""
    sdist = _fetch_sdist(work)
    prefix = f"llama_cpp_python-{SDIST_VERSION}/vendor/llama.cpp/"
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
        tar.extractall(work, members=members, filter="data")
    return work / prefix


def ensure_built() -> Path:
    """The cached `llama-server` binary, built if it is not there yet."""
    binary = server_binary()
    if binary.exists():
        return binary
    build_dir().mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="llama-build-") as tmp:
        work = Path(tmp)
        src = ensure_source(work)
        shutil.copy2(src / VOCAB, build_dir() / Path(VOCAB).name)
        out = work / "build"
        _log(f"building llama-server from {SDIST_NAME} {SDIST_VERSION} (once per machine)")
        t0 = time.monotonic()
        subprocess.run(
            [
                "cmake",
                "-S",
                str(src),
                "-B",
                str(out),
                "-DCMAKE_BUILD_TYPE=Release",
                "-DBUILD_SHARED_LIBS=OFF",
                "-DGGML_NATIVE=OFF",
                "-DLLAMA_BUILD_TESTS=OFF",
                "-DLLAMA_BUILD_EXAMPLES=OFF",
                "-DLLAMA_BUILD_UI=OFF",
                "-DLLAMA_USE_PREBUILT_UI=OFF",
                "-DLLAMA_OPENSSL=OFF",
                "-DLLAMA_CURL=OFF",
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        jobs = str(os.cpu_count() or 2)
        subprocess.run(
            ["cmake", "--build", str(out), "--target", "llama-server", "-j", jobs],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        built = out / "bin" / "llama-server"
        tmp_binary = binary.with_suffix(".partial")
        shutil.copy2(built, tmp_binary)
        tmp_binary.rename(binary)  # atomic: a half-copied binary is never taken as built
        _log(f"built {binary} in {time.monotonic() - t0:.0f} s")
    return binary


def ensure_model() -> Path:
    """The tiny random-weight Qwen2 GGUF, made once from the real vocabulary."""
    path = model_path()
    if path.exists():
        return path
    ensure_built()  # brings the vocabulary file
    import gguf
    import numpy as np

    vocab = gguf.GGUFReader(build_dir() / Path(VOCAB).name)
    n_vocab = len(vocab.fields["tokenizer.ggml.tokens"].data)
    rng = np.random.default_rng(MODEL_SEED)
    arch = "qwen2"
    partial = path.with_suffix(".partial")
    w = gguf.GGUFWriter(str(partial), arch)
    w.add_name(MODEL_NAME)
    w.add_context_length(N_CTX)
    w.add_embedding_length(N_EMBD)
    w.add_block_count(N_LAYER)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD_KV)
    w.add_rope_freq_base(1_000_000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for key, field in vocab.fields.items():
        if key.startswith("tokenizer."):
            _copy_field(w, key, field)

    def t(name: str, *shape: int, scale: float = 0.02, ones: bool = False) -> None:
        if ones:
            data = np.ones(shape, dtype=np.float32)
        else:
            data = (rng.standard_normal(shape) * scale).astype(np.float32)
        w.add_tensor(name, data.astype(np.float16) if len(shape) > 1 else data)

    head = N_EMBD // N_HEAD
    t("token_embd.weight", n_vocab, N_EMBD, scale=1.0)
    t("output_norm.weight", N_EMBD, ones=True)
    # an output projection of its own (not tied to the embeddings): greedy decoding then
    # wanders over the vocabulary instead of repeating the last token
    t("output.weight", n_vocab, N_EMBD, scale=1.0)
    for i in range(N_LAYER):
        t(f"blk.{i}.attn_norm.weight", N_EMBD, ones=True)
        t(f"blk.{i}.attn_q.weight", N_EMBD, N_EMBD)
        t(f"blk.{i}.attn_q.bias", N_EMBD)
        t(f"blk.{i}.attn_k.weight", N_HEAD_KV * head, N_EMBD)
        t(f"blk.{i}.attn_k.bias", N_HEAD_KV * head)
        t(f"blk.{i}.attn_v.weight", N_HEAD_KV * head, N_EMBD)
        t(f"blk.{i}.attn_v.bias", N_HEAD_KV * head)
        t(f"blk.{i}.attn_output.weight", N_EMBD, N_EMBD)
        t(f"blk.{i}.ffn_norm.weight", N_EMBD, ones=True)
        t(f"blk.{i}.ffn_gate.weight", N_FF, N_EMBD)
        t(f"blk.{i}.ffn_up.weight", N_FF, N_EMBD)
        t(f"blk.{i}.ffn_down.weight", N_EMBD, N_FF)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    partial.rename(path)
    _log(f"made {path} ({path.stat().st_size / 1e6:.1f} MB)")
    return path


QWEN2_PRETOKENIZE = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def tokenizer_path() -> Path:
    """A Hugging Face `tokenizer.json` (and its `tokenizer_config.json`, with the chat
    template) of the same Qwen2 vocabulary the server uses, made with the `tokenizers`
    package from the GGUF's tokens and merges: what a user's `--tokenizer` would be."""
    out = build_dir() / "hf-qwen2"
    path = out / "tokenizer.json"
    if path.exists():
        return path
    ensure_built()
    import gguf
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
    from tokenizers import pre_tokenizers as pre

    reader = gguf.GGUFReader(build_dir() / Path(VOCAB).name)
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    types = reader.fields["tokenizer.ggml.token_type"].contents()
    merges = [tuple(m.split(" ", 1)) for m in reader.fields["tokenizer.ggml.merges"].contents()]
    template = reader.fields["tokenizer.chat_template"].contents()
    control = gguf.TokenType.CONTROL
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab, merges, ignore_merges=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre.Sequence(
        [
            pre.Split(Regex(QWEN2_PRETOKENIZE), behavior="isolated"),
            pre.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    specials = [(i, t) for i, (t, k) in enumerate(zip(tokens, types, strict=True)) if k == control]
    for i, t in sorted(specials):
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False)])
        assert tok.token_to_id(t) == i, (t, i, tok.token_to_id(t))
    out.mkdir(parents=True, exist_ok=True)
    config = {"chat_template": template, "eos_token": "<|im_end|>", "bos_token": None}
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    partial = path.with_suffix(".partial")
    tok.save(str(partial))
    partial.rename(path)
    return path


def _copy_field(w: object, key: str, field: object) -> None:
    import gguf

    types = field.types  # type: ignore[attr-defined]
    value = field.contents()  # type: ignore[attr-defined]
    if types[0] == gguf.GGUFValueType.ARRAY:
        w.add_array(key, value)  # type: ignore[attr-defined]
    elif types[0] == gguf.GGUFValueType.STRING:
        w.add_string(key, value)  # type: ignore[attr-defined]
    else:
        w.add_key_value(key, value, types[0])  # type: ignore[attr-defined]


class LlamaServer:
    """A `llama-server` process on a free loopback port, stopped on exit."""

    def __init__(self, tmp: Path, *extra: str, parallel: int = 4, ctx: int = 8192) -> None:
        self.binary = ensure_built()
        self.model = ensure_model()
        self.log_path = tmp / f"llama-server-{time.monotonic_ns()}.log"
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [
            str(self.binary),
            "--model",
            str(self.model),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--ctx-size",
            str(ctx),
            "--parallel",
            str(parallel),
            "--threads",
            "1",
            "--no-webui",
            *extra,
        ]
        self._log = open(self.log_path, "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)
        self._wait_ready(120.0)

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as resp:
                    if resp.status == 200 and json.loads(resp.read()).get("status") == "ok":
                        return
            except OSError:
                pass
            time.sleep(0.2)
        self.stop()
        tail = self.log_path.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"llama-server did not become ready:\n{tail}")

    def post(self, path: str, body: dict[str, object]) -> dict[str, object]:
        req = urllib.request.Request(
            f"{self.url}{path}",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=60) as resp:
            obj: dict[str, object] = json.loads(resp.read())
            return obj

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()

    def __enter__(self) -> LlamaServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


if __name__ == "__main__":
    print(ensure_built())
    print(ensure_model())
    print(tokenizer_path())
