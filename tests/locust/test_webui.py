"""The Locust web UI in a real headless Chromium, driving a real run against the simulator.

A person's path through the UI: fill the start form (users and calculet's custom
parameters), start, open the "LLM (calculet)" tab and watch its figures and charts move,
set the rate and fire a burst with the tab's controls, change the rate in Locust's Edit
dialog (whose fixed parameters are greyed out, and refused if sent anyway), stop. The tab
keeps the run's figures after Stop, and they agree with the records; the run folder
holds what the form asked for, every change, and the series the charts drew.

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

from calculet_load.schema.liveseries import read_live_series
from calculet_load.schema.runfolder import read_records
from tests.support.ports import free_port
from tests.support.simproc import SimProcess

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
RATE, NEW_RATE, EDIT_RATE, BURST = 4.0, 8.0, 12.0, 5
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


def _fill(driver: Any, element_id: str, value: str) -> None:
    """Replace the text of one of the tab's inputs (by its id)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    el = driver.find_element(By.ID, element_id)
    el.send_keys(Keys.CONTROL, "a")
    el.send_keys(Keys.DELETE)
    el.send_keys(value)


def _said(driver: Any, button_id: str, expect: str) -> str:
    """Click one of the tab's buttons; the message it shows, once it contains `expect`."""
    from selenium.webdriver.common.by import By

    driver.find_element(By.ID, button_id).click()
    msg = driver.find_element(By.ID, "calculet-message")
    return str(_wait(lambda: expect in msg.text and msg.text, 15, f"the tab to say {expect!r}"))


_TABLE_JS = """
const t = document.getElementById('calculet-figures');
if (!t) return null;
const head = [...t.querySelectorAll('thead th')].map(c => c.innerText.trim());
const rows = [...t.querySelectorAll('tbody tr')].map(
  r => [...r.cells].map(c => c.innerText.trim()));
return {head, rows};
"""


def _llm_table(driver: Any) -> dict[str, dict[str, str]] | None:
    """The tab's figures table as {figure: {column title: text}}, None before it renders."""
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


def _done(table: dict[str, dict[str, str]]) -> int:
    return int(table["requests done"]["Value"])


CANCELLED = "cancelled (by the user, or at the stop)"


def _chart(driver: Any, name: str) -> dict[str, int]:
    """A chart's points and the marks drawn in its range (tab.js keeps them as data-*)."""
    el = driver.find_element("id", f"calculet-chart-{name}")
    canvases = el.find_elements("tag name", "canvas")
    return {
        "points": int(el.get_attribute("data-points")),
        "marks": int(el.get_attribute("data-marks")),
        "canvas": len(canvases),
    }


def _watch_the_stop(driver: Any, ui: LocustUI) -> list[dict[str, dict[str, str]]]:
    """Press Stop and read the tab until the run's index is complete (and one poll of
    the tab after that): every reading."""
    _click_text(driver, "button", "Stop")
    seen: list[dict[str, dict[str, str]]] = []
    deadline = time.monotonic() + 60
    complete_at = None
    while time.monotonic() < deadline:
        t = _llm_table(driver)
        if t is not None:
            seen.append(t)
        index = ui.index()
        if complete_at is None and index is not None and index["status"] == "complete":
            complete_at = time.monotonic()
        if complete_at is not None and time.monotonic() > complete_at + 5:
            return seen
        time.sleep(0.25)
    raise AssertionError(f"the run did not end\n{ui.log_text()}")


def _kept_figures(seen: list[dict[str, dict[str, str]]]) -> None:
    """From Stop on, the tab never falls back to nothing: requests done never goes
    down, and TTFT p50 stays a number."""
    done = [_done(t) for t in seen]
    assert done[0] > 0 and done == sorted(done), done
    ttft = [t["TTFT ms (from send)"]["p50"] for t in seen]
    assert all(_number(x) is not None for x in ttft), ttft


def _agrees_with_records(table: dict[str, dict[str, str]], run_dir: Path) -> dict[str, int]:
    """The tab's counters after the stop are the records' counts."""
    records = [r for r in read_records(str(run_dir)) if not r.ext.dropped]
    cancelled = sum(1 for r in records if r.ext.cancelled_at is not None)
    failed = sum(1 for r in records if r.ext.error_class and r.ext.cancelled_at is None)
    counts = {"requests": len(records), "failed": failed, "cancelled": cancelled}
    shown = {
        "requests": _done(table),
        "failed": int(table["failed"]["Value"]),
        "cancelled": int(table[CANCELLED]["Value"]),
    }
    assert shown == counts, (shown, counts)
    return counts


# ------------------------------------------------------------------ the tests
def test_start_form_live_tab_controls_edit_charts_and_stop(
    browser: Any, locust_ui: LocustUI
) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    ui = locust_ui
    # the controls refuse when no run is going on, and say why
    assert ui.post("/calculet/rate", {"rate": 2}) == (409, {"error": "no run is running"})
    assert ui.post("/calculet/rate", {"rate": -1})[0] == 400
    assert ui.post("/calculet/burst", {"size": 2})[0] == 409
    # so does the start form, for what the command line would refuse, naming the option
    for fields, says in (
        (
            {"prompt_tokens": "many"},
            "--prompt-tokens must be a whole number >= 1 and <= 40959, got 'many'",
        ),
        ({"arrival": "replay"}, "--replay-file is required with --arrival replay"),
        ({"rate": "nan"}, "--rate must be a number >= 0 and <= 1000000"),
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
            "--rate must be a number >= 0 and <= 1000000"
            in browser.find_element(By.TAG_NAME, "body").text
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
        if t is None or _done(t) < 4:
            return None
        return t if _number(t["TTFT ms (from send)"]["p50"]) is not None else None

    later = _wait(moved, 30, "live figures in the LLM tab", poll_s=0.5)
    assert float(later["TTFT ms (from send)"]["p50"]) > 0
    assert later["TTFT ms (from send)"]["Value"].startswith("n=")
    assert _wait(lambda: ui.get("/stats/requests")["user_count"] == USERS, 15, "users")

    # the tab's controls: a bad rate gets the endpoint's message, a good one applies
    _fill(browser, "calculet-rate", "-2")
    _said(browser, "calculet-set-rate", "rate must be a number >= 0 and <= 1000000, got '-2'")
    _fill(browser, "calculet-rate", "fast")
    _said(browser, "calculet-set-rate", "rate must be a number >= 0 and <= 1000000, got 'fast'")
    _fill(browser, "calculet-rate", f"{NEW_RATE:g}")
    _said(browser, "calculet-set-rate", f"rate {NEW_RATE:g}/s from 0.5 s ahead")
    _wait(lambda: len((ui.index() or {})["plan"]["rate_changes"]) == 1, 10, "the rate in the index")

    # Locust's Edit dialog: the fixed parameters greyed out, the rate the run's own
    _click_text(browser, "button", "Edit")
    _click_text(browser, "button", "Custom parameters")
    note = _wait(lambda: browser.find_elements(By.ID, "calculet-edit-note"), 15, "the note")
    text = note[0].get_attribute("textContent")
    assert "Edit changes --rate, --burst-size, --burst-lead at once" in text, text
    prompt = browser.find_element(By.NAME, "promptTokens")
    assert not prompt.is_enabled() and prompt.get_attribute("value") == str(PROMPT_TOKENS)
    arrival_box = browser.find_element(By.NAME, "arrival").find_element(
        By.XPATH, "ancestor::div[contains(@class, 'MuiFormControl-root')][1]"
    )
    assert "calculet-fixed" in arrival_box.get_attribute("class")
    rate_field = browser.find_element(By.NAME, "rate")
    _wait(rate_field.is_displayed, 10, "the Edit dialog's rate field")
    assert rate_field.get_attribute("value") == f"{NEW_RATE:g}"
    _type(browser, "rate", f"{EDIT_RATE:g}")
    _click_text(browser, "button", "Update")
    _wait(
        lambda: [r for _, r in (ui.index() or {})["plan"]["rate_changes"]] == [NEW_RATE, EDIT_RATE],
        15,
        "the Edit's rate in the index",
    )
    # what a running run cannot change is refused whole, with one line naming it
    refused = ui.start_form(user_count=str(USERS), arrival="poisson", rate="20", run_id="webui-run",
                            prompt_tokens=str(PROMPT_TOKENS))  # fmt: skip
    assert refused["success"] is False, refused
    assert (
        "cannot change while the run goes on: --arrival (constant → poisson)"
        in (refused["message"])
    )
    assert ui.get("/stats/requests")["state"] == "running"

    # a burst of N now, from the tab
    _fill(browser, "calculet-burst-size", "0")
    _said(browser, "calculet-fire-burst", "size must be a whole number >= 1 and <= 100000, got '0'")
    _fill(browser, "calculet-burst-size", str(BURST))
    said = _said(browser, "calculet-fire-burst", "burst webui-run.b")
    burst_id = said.split()[1]

    # the charts: points every second, the two rate changes and the burst marked
    _wait(
        lambda: all(
            c["points"] >= 8 and c["marks"] == 3 and c["canvas"] == 1
            for c in (_chart(browser, n) for n in ("ttft", "tpot", "itl", "load"))
        ),
        30,
        "charts with their points and marks",
        poll_s=0.5,
    )
    done_before = _done(later)
    _wait(
        lambda: _done(_llm_table(browser) or later) >= done_before + BURST + 10,
        30,
        "the burst and the faster arrivals in the LLM tab",
        poll_s=0.5,
    )
    browser.save_screenshot(str(ui.run_dir.parent / "llm-tab.png"))

    seen = _watch_the_stop(browser, ui)
    _kept_figures(seen)
    index = ui.index()
    assert index is not None and index["status"] == "complete", index
    _agrees_with_records(seen[-1], ui.run_dir)

    # the run folder: what the form asked for, parts from the one process, the controls
    assert index["run_id"] == "webui-run"
    opts = index["options"]
    assert (opts["arrival"], opts["prompt_tokens"], opts["max_tokens"]) == (
        "constant",
        PROMPT_TOKENS,
        MAX_TOKENS,
    )
    assert opts["num_users"] == USERS
    assert [r for _, r in index["plan"]["rate_changes"]] == [NEW_RATE, EDIT_RATE]
    assert [b["id"] for b in index["bursts"]] == [burst_id]
    (worker,) = index["workers"]
    assert worker["status"] == "reported" and worker["parts"], worker
    # the stop fetched the simulator's traces of this run into server/
    traces = index["server_traces"]
    assert traces["status"] == "fetched" and traces["kinds"]["server_events"]["rows"] > 0, traces
    assert (ui.run_dir / "server" / "server_events.jsonl").exists()
    parts = sorted((ui.run_dir / "client" / "w00").glob("part-*.requests.parquet"))
    assert parts, list(ui.run_dir.rglob("*"))

    # the series the charts drew, in the run folder: a point a second, the last at the end
    points = read_live_series(str(ui.run_dir), index["live_series"])
    assert len(points) == index["live_series"]["points"] >= 8
    assert points[-1].final and not any(p.final for p in points[:-1])
    assert [p.rate for p in points][:2] == [RATE, RATE] and points[-1].rate == EDIT_RATE
    assert points[-1].requests == _done(seen[-1])
    assert any(p.ttft_p50_ms is not None for p in points)
    assert all(b.wall_ns > a.wall_ns for a, b in itertools.pairwise(points))

    records = read_records(str(ui.run_dir))
    assert {r.workload.prompt_tokens for r in records} == {PROMPT_TOKENS}
    in_burst = [r for r in records if r.ext.burst_id == burst_id]
    assert len(in_burst) == BURST and {r.ext.arrival for r in in_burst} == {"burst"}
    # constant arrivals: spaced 1/RATE, then 1/NEW_RATE, then 1/EDIT_RATE, never back
    intended = sorted(
        r.ext.intended_start_ns
        for r in records
        if r.ext.arrival == "constant" and r.ext.intended_start_ns is not None
    )
    gaps_s = [(b - a) / 1e9 for a, b in itertools.pairwise(intended)]
    assert gaps_s[0] == pytest.approx(1 / RATE, abs=1e-5), gaps_s
    assert gaps_s[-1] == pytest.approx(1 / EDIT_RATE, abs=1e-5), gaps_s
    assert all(b <= a + 1e-5 for a, b in itertools.pairwise(gaps_s)), gaps_s
    for rate in (NEW_RATE, EDIT_RATE):
        assert sum(1 for g in gaps_s if g == pytest.approx(1 / rate, abs=1e-5)) >= 3, gaps_s


def test_after_stop_the_tab_keeps_its_figures_and_counts_the_cancelled(
    browser: Any, locust_ui: LocustUI
) -> None:
    """A closed loop's users are mid-request when Stop kills them: their requests are
    cancelled at the stop, never failed, in the tab as in the records; and from Stop to
    the next start the tab shows the run's figures, not "no data"."""
    ui = locust_ui
    # each user's request streams for about a second: at Stop, all are mid-stream
    answer = ui.start_form(user_count="4", spawn_rate="4", prompt_tokens="48",
                           max_tokens="400", run_id="stopped-run")  # fmt: skip
    assert answer["success"] is True, answer
    browser.get(ui.url + "/?tab=calculet")
    _wait(
        lambda: (t := _llm_table(browser)) is not None and _done(t) >= 8,
        45,
        "requests done in the LLM tab",
        poll_s=0.5,
    )
    seen = _watch_the_stop(browser, ui)
    _kept_figures(seen)
    counts = _agrees_with_records(seen[-1], ui.run_dir)
    assert counts["cancelled"] >= 1 and counts["failed"] == 0, counts
    live = ui.get("/calculet/live")
    assert live["counters"]["cancelled"] == counts["cancelled"], live["counters"]
    assert live["counters"].get("failed", 0) == 0, live["counters"]
    # the page opened afresh after the run shows the same figures
    browser.get(ui.url + "/?tab=calculet")
    again = _wait(lambda: _llm_table(browser), 15, "the LLM table after a reload")
    assert _done(again) == counts["requests"]


def test_an_edit_changes_the_bursts_live_and_refuses_a_rate_there(locust_ui: LocustUI) -> None:
    """`--arrival burst`: an Edit (the dialog's POST /swarm, every field as the form
    shows it) of the period and the size takes effect at once, and the index lists it."""
    ui = locust_ui
    form = {"user_count": "1", "spawn_rate": "1", "arrival": "burst", "burst_size": "2",
            "burst_every": "0", "start_delay": "0.5", "prompt_tokens": "48",
            "max_tokens": "8", "run_id": "bursts"}  # fmt: skip
    assert ui.start_form(**form)["success"] is True

    def bursts() -> list[dict[str, Any]]:
        return list((ui.index() or {}).get("bursts") or [])

    _wait(lambda: len(bursts()) == 1, 20, "the run's one burst")
    refused = ui.start_form(**{**form, "rate": "5"})
    assert refused["success"] is False and "--rate (1.0 → 5.0)" in refused["message"], refused
    assert "(Edit changes --burst-size, --burst-every, --burst-lead live)" in refused["message"]
    assert ui.start_form(**{**form, "burst_every": "1", "burst_size": "3"})["success"] is True
    _wait(lambda: len(bursts()) >= 3, 20, "a burst every second")
    assert [b["size"] for b in bursts()][:3] == [2, 3, 3]
    changes = [(c["option"], c["value"]) for c in (ui.index() or {})["option_changes"]]
    assert sorted(changes) == [("burst_every", 1.0), ("burst_size", 3)]
    assert ui.start_form(**{**form, "burst_every": "0", "burst_size": "3"})["success"] is True
    time.sleep(0.5)  # a burst the loop announced as the Edit came in
    settled = len(bursts())
    time.sleep(2.5)
    assert len(bursts()) == settled, bursts()
    status, _ = ui.post("/stop")
    assert status == 200
    index = _wait(
        lambda: (i := ui.index()) is not None and i["status"] == "complete" and i, 40, "the end"
    )
    records = read_records(str(ui.run_dir))
    sent = {b["id"]: sum(1 for r in records if r.ext.burst_id == b["id"]) for b in index["bursts"]}
    assert sent == {b["id"]: b["size"] for b in index["bursts"]}, sent
