"""A run that measured nothing never passes: real `locust` processes against targets that
are not there, not TLS, not an LLM endpoint, or that stop answering after the first
request. Each ends with exit 3 (2 where the user must name the target's kind) and one
line naming the URL and the cause; a target of a known kind is detected and said."""

from __future__ import annotations

import http.server
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.measure.test_hostile import SHORT_LLAMA
from tests.measure.test_hostile import http as http_response
from tests.support.hostile import RESET, serve
from tests.support.locustproc import LOCUSTFILE
from tests.support.ports import free_port
from tests.support.simproc import SimProcess

pytestmark = pytest.mark.timeout(120)

WRITTEN = Path(__file__).parents[1] / "data" / "llmusers" / "written_prompt.py"


def _locust(
    tmp: Path, host: str, *args: str, run_s: str = "30s", locustfile: str = LOCUSTFILE
) -> tuple[int, str, float]:
    began = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "locust", "-f", locustfile, "--headless", "-H", host,
         "-t", run_s, "--run-dir", str(tmp / "run"), *args],
        capture_output=True, text=True, timeout=90, check=False,
    )  # fmt: skip
    return done.returncode, done.stdout + done.stderr, time.monotonic() - began


def _ours(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("calculet-load:")]


def test_nothing_listening_fails_in_seconds(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    code, out, took = _locust(tmp_path, url)
    assert code == 3 and took < 10, (took, out)
    assert _ours(out) == [
        f"calculet-load: the target {url}/completion is not usable: nothing accepts "
        "connections there (connect_refused: [Errno 111] Connection refused)"
    ], out


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimProcess]:
    proc = SimProcess(tmp_path_factory.mktemp("startcheck"), "--time-scale", "0.1")
    yield proc
    proc.stop()


def test_https_to_a_plain_http_server_fails_in_seconds(tmp_path: Path, sim: SimProcess) -> None:
    url = sim.url.replace("http://", "https://")
    code, out, took = _locust(tmp_path, url)
    assert code == 3 and took < 10, (took, out)
    [line] = _ours(out)
    assert line.startswith(f"calculet-load: the target {url}/completion is not usable: the TLS")


@pytest.fixture
def web_server(tmp_path: Path) -> Iterator[str]:
    """A plain HTTP file server: answers, but is no LLM endpoint."""
    (tmp_path / "index.html").write_text("<html>hello</html>")

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *a: object, **kw: object) -> None:
            super().__init__(*a, directory=str(tmp_path), **kw)  # type: ignore[arg-type]

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_a_server_that_is_no_llm_endpoint_is_named(tmp_path: Path, web_server: str) -> None:
    code, out, took = _locust(tmp_path, web_server)
    assert code == 2 and took < 10, (took, out)
    [line] = _ours(out)  # its kind cannot be told: the option and its choices are named
    assert line.startswith(f"calculet-load: cannot tell what kind of server {web_server} is")
    assert line.endswith(
        "give --target-profile, one of calculet, llama.cpp, vllm, sglang, tgi, openai"
    )
    code, out, took = _locust(tmp_path, web_server, "--target-profile", "openai")
    assert code == 3 and took < 10, (took, out)
    [line] = _ours(out)
    assert "is not usable: it is not an LLM endpoint (http_5xx: HTTP 501" in line, line


def test_the_targets_kind_is_detected_and_said(tmp_path: Path, sim: SimProcess) -> None:
    code, out, _ = _locust(tmp_path, sim.url, "-u", "1", "-r", "1", run_s="3s")
    assert code == 0, out
    assert f"the target {sim.url} is calculet (/v1/models: owned_by 'calculet-sim')" in out


def test_a_run_whose_requests_got_no_answer_exits_3(tmp_path: Path) -> None:
    """The target answers the first request (the start's check) and resets every
    connection after it: the run sent its load, and not one request got an answer."""
    with serve([http_response(SHORT_LLAMA)], [RESET]) as srv:
        code, out, _ = _locust(tmp_path, srv.url, "--target-profile", "calculet",
                               "--rtt-samples", "0", "-u", "2", "-r", "2", run_s="4s",
                               locustfile=str(WRITTEN))  # fmt: skip
    assert code == 3, out
    [line] = [x for x in out.splitlines() if "measured nothing" in x]
    assert (
        "none of its" in line and "got an answer from the target (errors: connection_reset" in line
    )


def test_a_target_without_traces_or_metrics_is_not_asked_for_them(
    tmp_path: Path, sim: SimProcess
) -> None:
    """An OpenAI-compatible endpoint (`--target-profile openai`: a gateway) has neither:
    the run neither fetches `/traces/*` nor scrapes `/metrics` (404 warnings otherwise)."""
    code, out, _ = _locust(tmp_path, sim.url, "--target-profile", "openai", "--protocol",
                           "openai-completions", "--scrape-interval", "0.5", "-u", "1",
                           run_s="3s", locustfile=str(WRITTEN))  # fmt: skip
    assert code == 0, out
    index = json.loads((tmp_path / "run" / "client" / "index.json").read_text())
    assert index["server_traces"]["status"] == "not_available", index["server_traces"]
    assert index["server_traces"]["reason"] == "the openai profile has none"
    assert not (tmp_path / "run" / "server" / "metrics.jsonl").exists()
    assert "404" not in out and "/metrics" not in out.replace("no /metrics", ""), out


def test_a_target_that_cannot_size_prompts_is_refused_before_the_load(
    tmp_path: Path, sim: SimProcess
) -> None:
    """The built-in user builds exact-length prompts: against an `openai` target (no
    /tokenize) without --tokenizer the run is refused at once, naming the option, not
    after --run-time with every worker unable to prepare its load."""
    code, out, took = _locust(tmp_path, sim.url, "--target-profile", "openai", "--protocol",
                              "openai-completions")  # fmt: skip
    assert code == 2 and took < 15, (took, out)
    assert _ours(out) == [
        f"calculet-load: the target {sim.url} is openai, which cannot size prompts "
        "(no /tokenize): give --tokenizer FILE (the model's tokenizer.json)"
    ], out
