"""The peers of benchmarks/client_speed.py (`--peers`): other tools' clients, each run as
its users run it, in a venv of its own under `--peers-dir` (installed on first use from
the package index), against the same exact server and load.

- `vllm-bench`: vLLM 0.7.3's `benchmarks/benchmark_serving.py` (and the two modules it
  imports), taken from vLLM's source distribution on the index (the sha256 the index
  gives is checked), run under this interpreter with the packages it imports. Poisson:
  `--request-rate R`; closed loop: `--request-rate inf --max-concurrency C`. It opens a
  connection per request (aiohttp). Figures from its `--save-result` JSON: per request
  `ttfts`, `itls` (TPOT: their mean).
- `inference-perf`: inference-perf 0.7.0 (it needs Python >= 3.12: `--peers-python`),
  its per-request lifecycle metrics (`output_token_times` against `start_time`).

Both need a Hugging Face tokenizer for their random prompts; the machine cannot fetch
one from the hub, so `tokenizer_dir` writes one: a word-level vocabulary (`w0` ... `w3999`)
saved with transformers' `PreTrainedTokenizerFast` in the peer's venv.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
import tarfile
import urllib.request
import venv
from pathlib import Path
from typing import Any

import numpy as np
from speedkit import CpuWindow, ExactServer, Point, errors, taskset, truth_figures

INFERENCE_PERF = "inference-perf==0.7.0"
VLLM_VERSION = "0.7.3"
# what benchmark_serving.py and backend_request_func.py import (vLLM itself is optional
# there: without it they use transformers' AutoTokenizer and argparse)
VLLM_BENCH_PACKAGES = ["aiohttp", "numpy", "pandas", "datasets", "pillow", "tqdm", "transformers"]
# the script last: its presence says the three were written (`vllm_bench_script`)
VLLM_BENCH_FILES = ("backend_request_func.py", "benchmark_utils.py", "benchmark_serving.py")
INDEX = "https://pypi.org/simple"
Figures = dict[str, list[float]]  # "ttft", "itl", "tpot": ms, per request (ITL per gap)

TOKENIZER = """
import sys
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
vocab = {"[UNK]": 0, **{f"w{i}": i + 1 for i in range(4000)}}
tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(sys.argv[1])
"""


def peer_python(peers_dir: Path, name: str, packages: list[str], base: str | None) -> Path | None:
    """A venv of its own under `peers_dir` with `packages` (installed once), made by the
    interpreter `base` (inference-perf needs Python >= 3.12) or this one."""
    home = peers_dir / name
    python = home / "bin" / "python"
    stamp = home / ".installed"
    if stamp.exists():
        return python
    if base:
        made = subprocess.run(
            [base, "-m", "venv", "--clear", str(home)], capture_output=True, text=True
        )
        if made.returncode != 0:
            print(f"  {name}: {base} -m venv failed: {made.stderr.strip()[-300:]}", file=sys.stderr)
            return None
    else:
        venv.create(home, with_pip=True, clear=True)
    done = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", *packages], capture_output=True, text=True
    )
    if done.returncode != 0:
        print(f"  {name}: pip install failed: {done.stderr.strip()[-300:]}", file=sys.stderr)
        return None
    stamp.write_text(" ".join(packages))
    return python


def tokenizer_dir(peers_dir: Path, python: Path) -> Path:
    """A local Hugging Face tokenizer for the peers' random prompts (written once)."""
    out = peers_dir / "tokenizer"
    if not (out / "tokenizer.json").exists():
        subprocess.run([str(python), "-c", TOKENIZER, str(out)], check=True, capture_output=True)
    return out


def vllm_bench_script(peers_dir: Path) -> Path | None:
    """vLLM's benchmark_serving.py from its source distribution on the index (once)."""
    home = peers_dir / f"vllm-{VLLM_VERSION}-benchmarks"
    script = home / "benchmark_serving.py"
    if script.exists():
        return script
    name = f"vllm-{VLLM_VERSION}.tar.gz"
    try:
        with urllib.request.urlopen(f"{INDEX}/vllm/", timeout=60) as resp:
            page = resp.read().decode()
        found = re.search(rf'href="([^"]*/{re.escape(name)})#sha256=([0-9a-f]{{64}})"', page)
        if found is None:
            print(f"  vllm-bench: {name} is not on {INDEX}/vllm/", file=sys.stderr)
            return None
        with urllib.request.urlopen(found[1], timeout=300) as resp:
            data = resp.read()
    except OSError as exc:
        print(f"  vllm-bench: cannot fetch {name}: {exc}", file=sys.stderr)
        return None
    if hashlib.sha256(data).hexdigest() != found[2]:
        print(f"  vllm-bench: {name}'s sha256 is not the index's", file=sys.stderr)
        return None
    home.mkdir(parents=True, exist_ok=True)
    sdist = home / name
    sdist.write_bytes(data)
    with tarfile.open(sdist) as tar:
        for f in VLLM_BENCH_FILES:
            member = tar.extractfile(f"vllm-{VLLM_VERSION}/benchmarks/{f}")
            assert member is not None, f
            (home / f).write_bytes(member.read())
    sdist.unlink()
    return script


def _run(
    server: ExactServer, p: Point, seconds: float, cmd: list[str], cwd: Path
) -> tuple[list[list[Any]], int, str]:
    """Run a peer's command to its end, its CPU and the server's count over the steady
    window into `p`: (the server's truth, its exit code, its stderr's tail)."""
    window = CpuWindow(server)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=cwd)
    window.watch(proc, seconds)
    _, err = proc.communicate(timeout=seconds + 300)
    p.rate, p.cpu_percent, p.cpu_us_per_request = window.figures()
    truth = server.truth()
    p.requests = len(truth)
    return truth, proc.returncode, err.decode(errors="replace")[-300:]


def run_vllm_bench(
    server: ExactServer,
    p: Point,
    seconds: float,
    tmp: Path,
    core: int | None,
    python: Path,
    script: Path,
    tokenizer: Path,
) -> None:
    """benchmark_serving.py's own run with the same load; its per-request TTFT and ITLs
    are read back from its result JSON."""
    out = tmp / f"vllm-{p.mode}-{p.level:g}"
    out.mkdir(parents=True, exist_ok=True)
    if p.mode == "poisson":
        load = ["--request-rate", f"{p.level:g}", "--num-prompts", str(int(p.level * seconds))]
    else:  # as many as the concurrency gets through in `seconds` of 0.7-s requests
        n = int(p.level * seconds / 0.7)
        load = ["--request-rate", "inf", "--max-concurrency", f"{p.level:g}"]
        load += ["--num-prompts", str(n)]
    cmd = [*taskset(core), str(python), str(script), "--backend", "vllm"]
    cmd += ["--base-url", server.url, "--endpoint", "/v1/completions", "--model", "exact"]
    cmd += ["--tokenizer", str(tokenizer), "--dataset-name", "random", "--seed", "1"]
    cmd += ["--random-input-len", "128", "--random-output-len", "64", "--ignore-eos", *load]
    cmd += ["--save-result", "--result-dir", str(out), "--result-filename", "result.json"]
    truth, code, err = _run(server, p, seconds, cmd, script.parent)
    result = out / "result.json"
    if not result.exists():
        p.note = f"no result: exit {code}: {err}"
        return
    figures, p.failed = read_vllm_result(result)
    p.err = errors(figures, truth_figures(truth))


def read_vllm_result(path: Path) -> tuple[Figures, int]:
    """benchmark_serving.py's `--save-result` JSON: its figures, and the failed requests
    (an error, or no first token)."""
    doc: dict[str, Any] = json.loads(path.read_text())
    ttft: list[float] = []
    itl: list[float] = []
    tpot: list[float] = []
    failed = 0
    for first, gaps, error in zip(doc["ttfts"], doc["itls"], doc["errors"], strict=True):
        if error or not first:
            failed += 1
            continue
        ttft.append(first * 1e3)
        itl.extend(g * 1e3 for g in gaps)
        if gaps:
            tpot.append(float(np.mean(gaps)) * 1e3)
    return {"ttft": ttft, "itl": itl, "tpot": tpot}, failed


def run_inference_perf(
    server: ExactServer,
    p: Point,
    seconds: float,
    tmp: Path,
    core: int | None,
    python: Path,
    tokenizer: Path,
) -> None:
    """inference-perf's own run with the same load; its per-request lifecycle metrics are
    read back (TTFT, ITL, TPOT as it reports them)."""
    out = tmp / f"ip-{p.mode}-{p.level:g}"
    load: dict[str, Any]
    if p.mode == "poisson":
        load = {"type": "poisson", "stages": [{"rate": p.level, "duration": int(seconds)}]}
    else:
        n = int(p.level * seconds / 0.7)
        load = {
            "type": "concurrent",
            "stages": [{"num_requests": n, "concurrency_level": int(p.level)}],
        }
    config = {
        "load": load,
        "api": {"type": "completion", "streaming": True},
        "server": {"type": "vllm", "model_name": "exact", "base_url": server.url,
                   "ignore_eos": True},
        "tokenizer": {"pretrained_model_name_or_path": str(tokenizer)},
        "data": {"type": "random", "input_distribution": {"min": 128, "max": 128, "mean": 128,
                 "std_dev": 0}, "output_distribution": {"min": 64, "max": 64, "mean": 64,
                 "std_dev": 0}},
        "report": {"request_lifecycle": {"summary": True, "per_stage": False,
                   "per_request": True}},
        "storage": {"local_storage": {"path": str(out)}},
    }  # fmt: skip
    cfg = tmp / f"ip-{p.mode}-{p.level:g}.yaml"
    cfg.write_text(json.dumps(config))
    cmd = [*taskset(core), str(python.parent / "inference-perf"), "--config_file", str(cfg)]
    truth, _, err = _run(server, p, seconds, cmd, tmp)
    figures, p.failed = read_inference_perf(out)
    if not figures["ttft"]:
        p.note = f"no per-request metrics read: {err}"
    p.err = errors(figures, truth_figures(truth))


def read_inference_perf(out: Path) -> tuple[Figures, int]:
    """inference-perf's per-request lifecycle metrics under `out`: its figures, and the
    failed requests (an error, or no token times)."""
    ttft: list[float] = []
    itl: list[float] = []
    tpot: list[float] = []
    failed = 0
    for f in sorted(out.rglob("per_request_lifecycle_metrics.json")):
        for r in json.loads(f.read_text()):
            info = r.get("info") or {}
            # 0.7.0 keeps them under the response's metrics (earlier releases: in info)
            m = info.get("response_metrics") or info
            times = m.get("output_token_times") or []
            start = r.get("start_time")
            if r.get("error") or not times or start is None:
                failed += 1
                continue
            ttft.append((times[0] - start) * 1e3)
            itl.extend(float(x) for x in np.diff(np.asarray(times, dtype=float)) * 1e3)
            if len(times) > 1:
                tpot.append((times[-1] - times[0]) * 1e3 / (len(times) - 1))
    return {"ttft": ttft, "itl": itl, "tpot": tpot}, failed
