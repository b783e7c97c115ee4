"""Reports of real simulator runs opened in headless Chromium.

Four kinds of run are produced at once on loopback, each as cheaply as it can be: a
pair of short Locust runs (a baseline and a build whose decode step is 30% slower: a
REGRESSION; the baseline alone is the passing report), one broken fault scenario
(`calculet-load faults --broken`: a fault FAIL) and a time-scaled dev-soak rehearsal
with the simulator's leak knob on (a LEAK). Each report is opened in Chromium with the
page's CSP in force: the verdict, the counter-example sections and the plots are found,
the console has no error, the browser made no network request, and a screenshot is
kept. The Locust runs also sample the server's /metrics and process: those
series appear in the report's time series.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import yaml

from analysis.analyze import analyze, write_outputs
from analysis.judge.rules import DEFAULT_RULES
from analysis.report import write_report
from analysis.views.model import fmt_num
from tests.analysis.test_report import CHROMEDRIVER, CHROMIUM, Page, banner_code
from tests.analysis.test_report import check_self_contained as self_contained
from tests.conftest import REPO
from tests.support.locustproc import LocustRun
from tests.support.simproc import ADMIN_TOKEN, SimProcess

# the regression report compares two real-time runs, and short Locust runs lose requests
# on a busy machine: quiet (after the parallel phase, beside one other file at most)
pytestmark = [pytest.mark.timeout(240), pytest.mark.quiet]

MANIFEST = REPO / "configs" / "manifest.sim.yaml"
LOAD = ["-u", "1", "-r", "1", "--prompt-tokens", "512", "--max-tokens", "16"]
SCRAPE = ["--scrape-interval", "0.5"]
SLOWER_DECODE = ("--set", "timing.decode_base_ms=15.6")  # default 12.0 ms x 1.3
# a model name the simulator echoes in its 404 (output.reject_unknown_models), as vLLM does
INJECTED = "<script>document.title='pwned';window.__pwned=1</script>"
LEAK = ("--set", "knobs.leak.fds_per_request=1", "--set",
        "knobs.leak.rss_bytes_per_request=262144")  # fmt: skip
GOODPUT_TTFT_MS, GOODPUT_TPOT_MS = 2000.0, 100.0
VIEWPORT = (1400, 900)  # the first screen a reader sees; every page is laid out in it
ARTIFACTS = REPO / "build" / "test-artifacts"


@dataclass
class Runs:
    tmp: Path
    passing: Path
    regression: Path
    fault: Path
    soak: Path
    injected: Path
    codes: dict[str, int]


def _env() -> dict[str, str]:
    env = {**os.environ, "CALCULET_ADMIN_TOKEN": ADMIN_TOKEN}
    env.pop("CALCULET_SIGNING_KEY", None)
    env.pop("CALCULET_SIGNING_KEY_FILE", None)
    return env


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "calculet_drivers.cli", *args]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runs]:
    tmp = tmp_path_factory.mktemp("browser-runs")
    sims: list[SimProcess] = []
    try:
        # the Locust pair first and alone: the comparison's timing must not compete with
        # the soak's load for this machine's cores
        base_sim, slow_sim = SimProcess(tmp), SimProcess(tmp, *SLOWER_DECODE)
        sims += [base_sim, slow_sim]
        base = LocustRun(tmp, base_sim.url, [*LOAD, *SCRAPE], workers=0, run_time_s=8).start()
        slow = LocustRun(tmp, slow_sim.url, [*LOAD, *SCRAPE], workers=0, run_time_s=8).start()
        assert base.wait(90) == 0, base.log_text()
        assert slow.wait(90) == 0, slow.log_text()
        for sim, run in ((base_sim, base), (slow_sim, slow)):
            sim.stop()  # flushes the traces
            shutil.copytree(sim.trace_dir, run.run_dir / "server", dirs_exist_ok=True)
        fault_sim = SimProcess(tmp, "--time-scale", "0.02", faults=True)
        soak_sim = SimProcess(tmp, "--time-scale", "0.02", *LEAK, faults=True)
        sims += [fault_sim, soak_sim]
        fault_dir, soak_dir = tmp / "fault", tmp / "soak"
        fault = subprocess.Popen(
            _cli("faults", "--manifest", str(MANIFEST), "--url", fault_sim.url,
                 "--run-dir", str(fault_dir), "--scenarios", str(REPO / "configs/faults"),
                 "--only", "illegal_length", "--broken", "illegal_length"),
            cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )  # fmt: skip
        soak = subprocess.Popen(
            _cli("soak", "--manifest", str(MANIFEST), "--url", soak_sim.url,
                 "--run-dir", str(soak_dir), "--rules",
                 str(REPO / "tests/data/soak-rules.yaml"), "--stage", "dev",
                 "--duration-scale", "0.15", "--target-rate", "0.25"),
            cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )  # fmt: skip
        # a server string with a script in it: the simulator refuses the model the
        # requests name, echoing it in the error message the client records
        inj_sim = SimProcess(tmp, "--time-scale", "0.1", "--set",
                             "output.reject_unknown_models=true")  # fmt: skip
        sims.append(inj_sim)
        inj_args = [*LOAD, "--protocol", "openai-completions", "--model", INJECTED,
                    "--exit-code-on-error", "0"]  # fmt: skip
        inj = LocustRun(tmp, inj_sim.url, inj_args, workers=0, run_time_s=3).start()
        assert inj.wait(90) == 0, inj.log_text()
        inj_sim.stop()
        shutil.copytree(inj_sim.trace_dir, inj.run_dir / "server", dirs_exist_ok=True)
        fault_out, _ = fault.communicate(timeout=180)
        soak_out, _ = soak.communicate(timeout=180)
        assert fault.returncode == 1, fault_out.decode()[-3000:]
        assert soak.returncode == 1, soak_out.decode()[-3000:]

        # every default rule, except that this shared machine's own load must not make
        # the run infrastructure-invalid (as in test_e2e.py); and goodput SLOs (reported,
        # not judged: no min_share) so that the headline shows goodput
        rules = yaml.safe_load(DEFAULT_RULES.read_text())
        rules["infrastructure"]["max_saturated_fraction"] = None
        goodput = next(r for r in rules["rules"] if r["kind"] == "goodput")
        goodput.update(max_ttft_ms=GOODPUT_TTFT_MS, max_tpot_ms=GOODPUT_TPOT_MS)
        rules_path = tmp / "rules.yaml"
        rules_path.write_text(yaml.safe_dump(rules))
        codes = {"fault": fault.returncode, "soak": soak.returncode}
        passing = tmp / "passing"
        shutil.copytree(base.run_dir, passing)
        for name, run, baseline in (("passing", passing, None),
                                    ("regression", slow.run_dir, base.run_dir)):  # fmt: skip
            result = analyze(str(run), baseline=str(baseline) if baseline else None,
                             rules_path=rules_path)  # fmt: skip
            write_outputs(result, str(run))
            codes[name] = int(result.document["exit_code"])
            assert result.document["run"]["records"] >= 10, result.document["run"]
            write_report(str(run), baseline=str(baseline) if baseline else None)
        write_outputs(analyze(str(inj.run_dir), rules_path=rules_path), str(inj.run_dir))
        for run in (fault_dir, soak_dir, inj.run_dir):
            if not (run / "report.html").exists():
                write_report(str(run))
        yield Runs(tmp, passing, slow.run_dir, fault_dir, soak_dir, inj.run_dir, codes)
    finally:
        for sim in sims:
            sim.stop()


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    if not (CHROMIUM and CHROMEDRIVER):
        pytest.fail("chromium and chromedriver are needed: run scripts/setup as root")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    log = tmp_path_factory.mktemp("chromium") / "driver.log"
    opts = webdriver.ChromeOptions()
    opts.binary_location = str(CHROMIUM)
    for arg in ("--headless", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1400,1000",
                # network blocked: every host resolves nowhere (the CSP blocks it as well)
                "--host-resolver-rules=MAP * ~NOTFOUND", "--proxy-server=127.0.0.1:9"):  # fmt: skip
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    driver = webdriver.Chrome(
        options=opts, service=Service(executable_path=str(CHROMEDRIVER), log_output=str(log))
    )
    driver.set_page_load_timeout(30)
    width, height = VIEWPORT
    driver.execute_cdp_cmd(
        "Emulation.setDeviceMetricsOverride",
        {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
    )
    yield driver
    driver.quit()


def _open(browser: Any, run: Path, shot: Path) -> dict[str, Any]:
    """Open the report; return what the page shows. Asserts the browser-level facts
    every report shares: plots drawn, no console error, no network request."""
    browser.get_log("browser")  # drop what an earlier page left
    browser.get_log("performance")
    browser.get((run / "report.html").as_uri())
    charts_js = (
        "return document.readyState === 'complete' ? "
        "document.querySelectorAll('svg.plot').length : -1"
    )
    charts = browser.execute_script(charts_js)
    drawn_js = (
        "return Array.from(document.querySelectorAll('svg.plot'))"
        ".filter(s => s.getBoundingClientRect().width > 100 && s.querySelector('path')).length"
    )
    # a large page may still be laying out when get() returns: wait (bounded) for it
    deadline = time.monotonic() + 15
    drawn = browser.execute_script(drawn_js)
    while drawn != charts and time.monotonic() < deadline:
        time.sleep(0.2)
        charts = browser.execute_script(charts_js)
        drawn = browser.execute_script(drawn_js)
    assert charts >= 1 and drawn == charts
    assert browser.execute_script("return performance.getEntriesByType('resource').length") == 0
    errors = [e for e in browser.get_log("browser") if e.get("level") == "SEVERE"]
    assert errors == []
    sent = []
    for entry in browser.get_log("performance"):
        msg = json.loads(entry["message"])["message"]
        if msg.get("method") == "Network.requestWillBeSent":
            url = msg["params"]["request"]["url"]
            if not url.startswith("file:"):
                sent.append(url)
    assert sent == []  # only the report file itself was loaded
    # every table fits the 1,400-px page (wrapping, never a scroll bar of its own), with
    # its <details> open
    browser.execute_script("document.querySelectorAll('details').forEach(d => d.open = true)")
    wide = browser.execute_script(
        "return Array.from(document.querySelectorAll('.tablewrap'))"
        ".filter(w => w.scrollWidth > w.clientWidth + 1)"
        ".map(w => [w.querySelector('table').dataset.table, w.scrollWidth, w.clientWidth])"
    )
    assert wide == []
    assert browser.execute_script("return document.documentElement.scrollWidth") <= VIEWPORT[0]
    browser.execute_script("document.querySelectorAll('details').forEach(d => d.open = false)")
    browser.execute_script("window.scrollTo(0, 0)")
    browser.save_screenshot(str(shot))
    assert shot.stat().st_size > 10_000
    return {
        "code": browser.find_element("id", "verdict").get_attribute("data-exit-code"),
        "charts": charts,
        "sections": browser.execute_script(
            "return Array.from(document.querySelectorAll('section[id]')).map(s => s.id)"
        ),
        "title": browser.title,
    }


def _section_text(html: str, name: str) -> str:
    return Page(html).sections[name]


def test_passing_report(runs: Runs, browser: Any) -> None:
    html = (runs.passing / "report.html").read_text()
    page = self_contained(html)
    assert runs.codes["passing"] == 0
    assert banner_code(page) == "0"
    seen = _open(browser, runs.passing, runs.tmp / "passing.png")
    assert seen["code"] == "0" and seen["charts"] >= 5
    assert {"verdicts", "cells", "slowest", "nonsuccess", "longctx"} <= set(seen["sections"])
    assert 0 < len(page.tables["slowest"]) <= 20


def test_regression_report(runs: Runs, browser: Any) -> None:
    html = (runs.regression / "report.html").read_text()
    page = self_contained(html)
    assert runs.codes["regression"] == 4
    assert banner_code(page) == "4"
    assert "no data in this run" not in page.sections["comparison"]
    assert "regression" in page.sections["comparison"].lower()
    assert page.tables.get("wins-losses")
    seen = _open(browser, runs.regression, runs.tmp / "regression.png")
    assert seen["code"] == "4" and seen["charts"] >= 5
    assert {"slowest", "server"} <= set(seen["sections"])


def test_fault_failure_report(runs: Runs, browser: Any) -> None:
    doc = json.loads((runs.fault / "faults.json").read_text())
    html = (runs.fault / "report.html").read_text()
    page = self_contained(html)
    faults = page.tables["faults"]
    assert [r[1] for r in faults] == ["illegal_length"]
    assert faults[0][4] == "yes" and faults[0][5] == "FAIL"
    checks = page.tables["fault-illegal_length"]
    failed = [r for r in checks if r[1] == "FAILED"]
    assert failed and any("requests[illegal]" in r[0] for r in failed)
    assert len(checks) == min(len(doc["scenarios"][0]["checks"]), 60)
    # no verdict.json in a fault-matrix folder: the banner shows the matrix's exit code
    assert doc["exit_code"] == 1 and banner_code(page) == "1"
    assert "fault scenario illegal_length" in html and "faults.json" in html
    seen = _open(browser, runs.fault, runs.tmp / "fault.png")
    assert "faults" in seen["sections"] and seen["code"] == "1"
    assert browser.execute_script("return document.querySelectorAll('#faults svg.plot').length")
    assert browser.find_element("id", "faults").is_displayed()


def test_soak_leak_report(runs: Runs, browser: Any) -> None:
    html = (runs.soak / "report.html").read_text()
    page = self_contained(html)
    leaks = {r[0]: r for r in page.tables["leaks"]}
    assert leaks["fds"][6] == "leak" and leaks["rss_bytes"][6] == "leak"
    assert banner_code(page) not in ("", "0")
    seen = _open(browser, runs.soak, runs.tmp / "soak.png")
    assert "soak" in seen["sections"]
    resources = browser.execute_script("return document.querySelectorAll('#soak svg.plot').length")
    assert resources >= 1


def test_server_metrics_and_process_samples_appear_in_the_time_series(runs: Runs) -> None:
    """A Locust run samples the server's /metrics and process into the run
    folder; the report's time series show both."""
    server = runs.regression / "server"
    assert (server / "metrics.jsonl").stat().st_size and (server / "process.jsonl").stat().st_size
    metrics = [json.loads(x) for x in (server / "metrics.jsonl").read_text().splitlines()]
    process = [json.loads(x) for x in (server / "process.jsonl").read_text().splitlines()]
    html = (runs.regression / "report.html").read_text()
    page = self_contained(html)
    assert "no data" not in page.sections["server"]
    assert f"{len(metrics)} scrapes" in page.sections["server"]
    assert f"{len(process)} samples of its process" in page.sections["server"]
    rows = {r[1]: r for r in page.tables["server-series"]}
    for series in ("jobs and sequences: jobs in flight", "KV tokens: allocated",
                   "output buffer pool: leased", "server RSS MiB: rss_bytes",
                   "server CPU %: cpu_percent", "server threads: threads",
                   "server open FDs: fds"):  # fmt: skip
        assert series in rows, sorted(rows)
    assert rows["jobs and sequences: jobs in flight"][0] == "metrics.jsonl"
    assert rows["server RSS MiB: rss_bytes"][0] == "process.jsonl"
    assert int(rows["server RSS MiB: rss_bytes"][2].replace(",", "")) == len(process)
    assert float(rows["server RSS MiB: rss_bytes"][5].replace(",", "")) > 10  # MiB
    assert float(rows["jobs and sequences: jobs in flight"][5]) >= 1  # the load was seen
    assert float(rows["server open FDs: fds"][5]) >= 3
    figure = html[html.index('<section id="server"') :]
    figure = figure[: figure.index("</section>")]
    assert figure.count('<svg class="plot"') == 1
    for label in ("jobs in flight", "server RSS MiB", "server open FDs", "KV tokens"):
        assert label in figure, label


def test_a_script_the_server_sends_back_stays_inert(runs: Runs, browser: Any) -> None:
    """A server string (the simulator's error message echoing the model name)
    reaches the report escaped, and Chromium runs no script of it."""
    html = (runs.injected / "report.html").read_text()
    page = self_contained(html)  # no <script> element at all
    assert INJECTED not in html
    escaped = "&lt;script&gt;document.title=&#39;pwned&#39;;window.__pwned=1&lt;/script&gt;"
    assert escaped in html
    failed = page.tables["nonsuccess"]
    assert failed and all(r[8] == f"The model `{INJECTED}` does not exist." for r in failed)
    seen = _open(browser, runs.injected, runs.tmp / "injected.png")
    assert "pwned" not in seen["title"]
    assert browser.execute_script("return typeof window.__pwned") == "undefined"
    assert browser.execute_script("return document.scripts.length") == 0
    shown = browser.execute_script("return document.getElementById('nonsuccess').textContent")
    assert INJECTED in shown  # shown as text (in a folded table), as the server sent it


def test_the_first_screen_says_whether_it_passed_and_how_fast(runs: Runs, browser: Any) -> None:
    """At 1,400 x 900 the first viewport holds the verdict and the whole headline table
    (positions from the DOM); then come the latency-over-time charts; every axis reads in
    plain numbers. The screenshot is kept in build/test-artifacts/."""
    html = (runs.passing / "report.html").read_text()
    page = self_contained(html)
    headline = page.tables["headline"]
    doc = json.loads((runs.passing / "verdict.json").read_text())
    measured = [c for c in doc["cells"] if c["partition"] == "measured"]
    assert len(headline) == len(measured) >= 1
    (good,) = doc["goodput"]["cells"]
    assert (good["max_ttft_ms"], good["max_tpot_ms"]) == (GOODPUT_TTFT_MS, GOODPUT_TPOT_MS)
    row = headline[0]
    assert row[0].startswith(good["cell"])
    assert row[7].startswith(f"{fmt_num(good['goodput_rps'])}/s")
    assert f"({good['good']:,} of {good['attempts']:,})" in row[7]
    # what a missing interval lacks, in so many words: TTFT P99 rests on too few values
    summary = pq.read_table(runs.passing / "summary.parquet").to_pylist()
    ttft = next(r for r in summary if r["metric"] == "ttft_ms" and r["partition"] == "measured")
    n = ttft["count"]
    assert n < 368 and f"no upper bound: n\xa0=\xa0{n}\xa0<\xa0368]" in row[2], row[2]
    seen = _open(browser, runs.passing, runs.tmp / "first-screen.png")
    assert seen["sections"][:2] == ["headline", "overtime"]  # before the contents
    rect = browser.execute_script(
        "const r = e => { const b = document.querySelector(e).getBoundingClientRect();"
        " return [b.top, b.bottom, b.left, b.right]; };"
        " return {verdict: r('#verdict'), table: r('table[data-table=\"headline\"]'),"
        " charts: r('figure[data-figure=\"overtime\"]'), height: window.innerHeight,"
        " width: window.innerWidth}"
    )
    assert (rect["width"], rect["height"]) == VIEWPORT
    assert rect["verdict"][0] == 0 and rect["verdict"][1] < rect["table"][0]
    assert rect["table"][1] <= VIEWPORT[1] and rect["table"][3] <= VIEWPORT[0]
    assert rect["charts"][0] >= rect["table"][1]  # the charts follow the table
    # the charts: six panels, plain numbers on every axis (no ×10ⁿ, no offset)
    figure = html[html.index('<figure data-figure="overtime"') :]
    figure = figure[: figure.index("</figure>")]
    for label in ("TTFT ms", "TPOT ms", "ITL ms", "output tokens/s", "requests in flight"):
        assert label in figure, label
    texts = re.findall(r"<text[^>]*>(.*?)</text>", html, re.S)  # every figure's text
    assert texts and not [t for t in texts if "×" in t or "mathdefault" in t or "^" in t]
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shutil.copy(runs.tmp / "first-screen.png", ARTIFACTS / "report-first-screen-1400x900.png")
