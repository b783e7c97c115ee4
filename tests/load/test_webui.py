"""The Locust web UI in a real headless Chromium, driving a real run against the simulator.

A person's path through the UI: fill the start form (users and calculet's custom
parameters), start, open the "LLM (calculet)" tab and watch its figures move, change the
rate and fire a burst through `/calculet/*` while the open-loop run goes on, stop. Then
the run folder must hold what the form asked for.

Needs Debian's `chromium` and `chromium-driver`; `scripts/setup` installs them when run
as root. The test is skipped (with the reason) only where they are absent and cannot be
installed; where they could be, it fails and says how.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from calculet_load.schema.runfolder import read_records
from tests.ports import free_port
from tests.simproc import SimProcess

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
MISSING = [n for n, p in (("chromium", CHROMIUM), ("chromedriver", CHROMEDRIVER)) if not p]
CANNOT_INSTALL = (
    "not root" if os.geteuid() != 0 else "no apt-get" if not shutil.which("apt-get") else ""
)

pytestmark = [
    pytest.mark.timeout(150),
    pytest.mark.skipif(
        bool(MISSING and CANNOT_INSTALL),
        reason=f"{' and '.join(MISSING)} not installed, and scripts/setup cannot install "
        f"Debian's chromium and chromium-driver here ({CANNOT_INSTALL})",
    ),
]

TAB = "LLM (calculet)"
USERS, PROMPT_TOKENS, MAX_TOKENS = 3, 48, 12
RATE, NEW_RATE, BURST = 4.0, 10.0, 5
# The schedule starts this long after Start: the tab is open and shows "no data" first.
START_DELAY_S = 4.0


def _wait(cond: Callable[[], Any], timeout_s: float, what: str, poll_s: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


class LocustUI:
    """`locust -f locustfiles/calculet.py` with its web UI on a loopback port."""

    def __init__(self, tmp: Path, host: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.run_dir = tmp / "run"
        self.log = tmp / "locust.log"
        locust = Path(sys.executable).with_name("locust")
        cmd = [str(locust), "-f", "locustfiles/calculet.py", "-H", host]
        cmd += ["--web-host", "127.0.0.1", "--web-port", str(self.port)]
        cmd += ["--run-dir", str(self.run_dir)]
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=dict(os.environ)
            )
        _wait(self._up, 30, f"the web UI at {self.url}\n{self.log_text()}")

    def _up(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"locust exited {self.proc.returncode}:\n{self.log_text()}")
        try:
            with urllib.request.urlopen(self.url + "/", timeout=2) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    def post(self, path: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
        data = json.dumps(body).encode() if body is not None else b""
        req = urllib.request.Request(
            self.url + path, data=data, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status, json.loads(r.read() or b"null")
        except urllib.error.HTTPError as e:
            with e:
                return e.code, json.loads(e.read() or b"null")

    def start_form(self, **fields: str) -> Any:
        """POST /swarm as the start form does (urlencoded), without a browser."""
        data = urllib.parse.urlencode({"user_count": "1", "spawn_rate": "1", **fields}).encode()
        with urllib.request.urlopen(self.url + "/swarm", data=data, timeout=10) as r:
            return json.loads(r.read())

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(self.url + path, timeout=10) as r:
            return json.loads(r.read())

    def index(self) -> dict[str, Any] | None:
        path = self.run_dir / "client" / "index.json"
        return dict(json.loads(path.read_text())) if path.exists() else None

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")[-6000:] if self.log.exists() else ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def locust_ui(tmp_path: Path, start_sim: Callable[..., SimProcess]) -> Iterator[LocustUI]:
    # the default profile 50x faster: a 48/12 request takes a few tens of ms
    sim = start_sim("--time-scale", "0.02")
    ui = LocustUI(tmp_path, sim.url)
    yield ui
    ui.stop()


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    if MISSING:
        pytest.fail(
            f"{' and '.join(MISSING)} not installed: run scripts/setup as root "
            "(it installs Debian's chromium and chromium-driver)"
        )
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = str(CHROMIUM)
    for arg in ("--headless", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        opts.add_argument(arg)
    opts.add_argument("--window-size=1400,1000")
    # both paths given: Selenium Manager (which would download a driver) is never run
    service = Service(executable_path=str(CHROMEDRIVER), log_output=str(tmp_path / "driver.log"))
    driver = webdriver.Chrome(options=opts, service=service)
    driver.set_page_load_timeout(30)
    driver.set_script_timeout(10)
    yield driver
    driver.quit()


# ------------------------------------------------------------------ page helpers
def _type(driver: Any, name: str, value: str) -> None:
    """Replace an input's text by keystrokes, so React's onChange sees it."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    el = driver.find_element(By.NAME, name)
    assert el.is_displayed(), f"form field {name} is not visible"
    el.send_keys(Keys.CONTROL, "a")
    el.send_keys(Keys.DELETE)
    el.send_keys(value)
    assert el.get_attribute("value") == value, (name, el.get_attribute("value"))


def _click_text(driver: Any, xpath_tag: str, text: str, timeout_s: float = 15) -> None:
    from selenium.webdriver.common.by import By

    xpath = f"//{xpath_tag}[normalize-space(.)={json.dumps(text)}]"

    def find() -> Any:
        els = [e for e in driver.find_elements(By.XPATH, xpath) if e.is_displayed()]
        return els[0] if els else None

    _wait(find, timeout_s, f"a visible {xpath_tag} {text!r}").click()


_TABLE_JS = """
const t = document.querySelector('table');
if (!t) return null;
const head = [...t.querySelectorAll('thead th')].map(c => c.innerText.trim());
const rows = [...t.querySelectorAll('tbody tr')].map(
  r => [...r.cells].map(c => c.innerText.trim()));
return {head, rows};
"""


def _llm_table(driver: Any) -> dict[str, dict[str, str]] | None:
    """The LLM tab's table as {figure: {column title: text}}, None before it renders."""
    table = driver.execute_script(_TABLE_JS)
    if not table or not table["rows"] or table["head"][:1] != ["Figure"]:
        return None
    head = table["head"]
    return {r[0]: dict(zip(head, r, strict=True)) for r in table["rows"] if len(r) == len(head)}


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


# ------------------------------------------------------------------ the test
def test_start_form_live_tab_rate_burst_and_stop(browser: Any, locust_ui: LocustUI) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    ui = locust_ui
    # the controls refuse when no run is going on, and say why
    assert ui.post("/calculet/rate", {"rate": 2})[0] == 409
    assert ui.post("/calculet/rate", {"rate": -1})[0] == 400
    assert ui.post("/calculet/burst", {"size": 2})[0] == 409
    # so does the start form, for what the command line would refuse, naming the option
    for fields, says in (
        ({"prompt_tokens": "many"}, "--prompt-tokens: expected int, got 'many'"),
        ({"arrival": "replay"}, "--replay-file is required with --arrival replay"),
        ({"rate": "nan"}, "--rate must be a finite number >= 0"),
    ):
        answer = ui.start_form(**fields)
        assert answer["success"] is False and says in answer["message"], answer
    assert ui.get("/stats/requests")["state"] == "ready" and ui.index() is None

    browser.get(ui.url + "/")
    _wait(lambda: browser.find_elements(By.NAME, "userCount"), 20, "the start form")
    _type(browser, "userCount", str(USERS))
    _type(browser, "spawnRate", "10")
    _click_text(browser, "button", "Custom parameters")
    _wait(lambda: browser.find_element(By.NAME, "promptTokens").is_displayed(), 10, "fields")
    Select(browser.find_element(By.NAME, "arrival")).select_by_value("constant")
    _type(browser, "promptTokens", str(PROMPT_TOKENS))
    _type(browser, "maxTokens", str(MAX_TOKENS))
    _type(browser, "startDelay", str(START_DELAY_S))
    _type(browser, "runId", "webui-run")

    # a value the command line refuses is refused by the form too, with the same line
    _type(browser, "rate", "-2")
    _click_text(browser, "button", "Start")
    _wait(
        lambda: (
            "--rate must be a finite number >= 0" in browser.find_element(By.TAG_NAME, "body").text
        ),
        15,
        "the form to refuse --rate -2",
    )
    assert ui.index() is None and ui.get("/stats/requests")["state"] == "ready"

    _type(browser, "rate", str(RATE))
    _click_text(browser, "button", "Start")

    _click_text(browser, "button[@role='tab']", TAB)
    first = _wait(lambda: _llm_table(browser), 15, "the LLM table")
    assert first["requests done"]["Value"] == "0", first["requests done"]
    assert first["TTFT ms (from send)"]["p50"] == "no data", first["TTFT ms (from send)"]

    # the table follows the run: requests done grows, TTFT p50 becomes a number
    def moved() -> dict[str, dict[str, str]] | None:
        t = _llm_table(browser)
        if t is None or int(t["requests done"]["Value"]) < 4:
            return None
        return t if _number(t["TTFT ms (from send)"]["p50"]) is not None else None

    later = _wait(moved, 30, "live figures in the LLM tab", poll_s=0.5)
    assert float(later["TTFT ms (from send)"]["p50"]) > 0
    assert later["TTFT ms (from send)"]["Value"].startswith("n=")
    assert _wait(lambda: ui.get("/stats/requests")["user_count"] == USERS, 15, "users")

    # controls of a running open-loop run
    status, body = ui.post("/calculet/rate", {"rate": NEW_RATE})
    assert (status, body) == (200, {"rate": NEW_RATE})
    status, burst = ui.post("/calculet/burst", {"size": BURST})
    assert status == 200 and burst["id"].startswith("webui-run."), burst
    done_before = int(later["requests done"]["Value"])
    _wait(
        lambda: (
            int((_llm_table(browser) or later)["requests done"]["Value"])
            >= done_before + BURST + 10
        ),
        30,
        "the burst and the faster arrivals in the LLM tab",
        poll_s=0.5,
    )

    status, _ = ui.post("/stop")
    assert status == 200
    index = _wait(
        lambda: (i := ui.index()) is not None and i["status"] == "complete" and i,
        40,
        f"client/index.json to be complete\n{ui.log_text()}",
    )

    # the run folder: what the form asked for, parts from the one process, the controls
    assert index["run_id"] == "webui-run"
    opts = index["options"]
    assert (opts["arrival"], opts["prompt_tokens"], opts["max_tokens"]) == (
        "constant",
        PROMPT_TOKENS,
        MAX_TOKENS,
    )
    assert opts["num_users"] == USERS
    assert [r for _, r in index["plan"]["rate_changes"]] == [NEW_RATE]
    assert [b["id"] for b in index["bursts"]] == [burst["id"]]
    (worker,) = index["workers"]
    assert worker["status"] == "reported" and worker["parts"], worker
    # the stop fetched the simulator's traces of this run into server/ (issue 17)
    traces = index["server_traces"]
    assert traces["status"] == "fetched" and traces["kinds"]["server_events"]["rows"] > 0, traces
    assert (ui.run_dir / "server" / "server_events.jsonl").exists()
    parts = sorted((ui.run_dir / "client" / "w00").glob("part-*.requests.parquet"))
    assert parts, list(ui.run_dir.rglob("*"))

    records = read_records(str(ui.run_dir))
    assert {r.workload.prompt_tokens for r in records} == {PROMPT_TOKENS}
    in_burst = [r for r in records if r.ext.burst_id == burst["id"]]
    assert len(in_burst) == BURST and {r.ext.arrival for r in in_burst} == {"burst"}
    # constant arrivals: spaced 1/RATE, then 1/NEW_RATE after the change, never back
    intended = sorted(
        r.ext.intended_start_ns
        for r in records
        if r.ext.arrival == "constant" and r.ext.intended_start_ns is not None
    )
    gaps_s = [(b - a) / 1e9 for a, b in itertools.pairwise(intended)]
    assert gaps_s[0] == pytest.approx(1 / RATE, abs=1e-5), gaps_s
    assert gaps_s[-1] == pytest.approx(1 / NEW_RATE, abs=1e-5), gaps_s
    assert all(b <= a + 1e-5 for a, b in itertools.pairwise(gaps_s)), gaps_s
    assert sum(1 for g in gaps_s if g == pytest.approx(1 / NEW_RATE, abs=1e-5)) >= 5, gaps_s
