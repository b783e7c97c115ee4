"""The HTML acceptance report (`analysis.report`, `calculet-load report`).

Rendered from a small hand-built run folder (every section, fast) and from a real
`calculet-load accept` run against the simulator, then parsed as HTML and opened in a
real headless Chromium: one self-contained file, the banner says what verdict.json
says, every cell with its n, at most 20 slowest requests sorted by E2E, "no data" for
what the run lacks, server strings escaped, no secret and no prompt text.
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import yaml

from analysis.analyze import analyze, write_outputs
from analysis.report import build_view, render, write_report
from analysis.tables.cells import CellKey
from analysis.views.model import label_column
from calculet_drivers.cli import main
from calculet_load.measure.prompts import sample_words
from tests.support.runs import (
    MS,
    WALL0,
    RunBuilder,
    device_row,
    request,
    selfwatch,
    server_chain,
    step_row,
)
from tests.support.simproc import ADMIN_TOKEN, SimProcess

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
INJECTED = "<script>alert('x')</script>"
SECRET = "s3cr3t-admin-token-0123456789"


# ------------------------------------------------------------------ HTML parsing
class Page(HTMLParser):
    """Every start tag with its attributes, tables by their data-table name (rows of
    cell texts), sections by id with their text."""

    def __init__(self, html: str) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.tables: dict[str, list[list[str]]] = {}
        self.sections: dict[str, str] = {}
        self._table: str | None = None
        self._row: list[str] | None = None
        self._cell: list[str] | None = None
        self._in_head = False
        self._section: str | None = None
        self.title = ""
        self._in_title = False
        self.feed(html)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        self.tags.append((tag, a))
        if tag == "table":
            self._table = a.get("data-table") or ""
            self.tables.setdefault(self._table, [])
        elif tag == "tr" and self._table is not None:
            self._row = []
        elif tag == "td" and self._row is not None:
            self._cell = []
        elif tag == "section":
            self._section = a.get("id")
            self.sections[self._section or ""] = ""
        elif tag == "title":
            self._in_title = True

    def handle_endtag(self, tag: str) -> None:
        if tag == "td" and self._cell is not None and self._row is not None:
            self._row.append("".join(self._cell).strip())
            self._cell = None
        elif tag == "tr" and self._row is not None and self._table is not None:
            if self._row:
                self.tables[self._table].append(self._row)
            self._row = None
        elif tag == "table":
            self._table = None
        elif tag == "section":
            self._section = None
        elif tag == "title":
            self._in_title = False

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)
        if self._section is not None:
            self.sections[self._section] += data
        if self._in_title:
            self.title += data


def check_self_contained(html: str) -> Page:
    page = Page(html)
    for tag, attrs in page.tags:
        assert tag not in ("script", "link", "iframe", "object", "embed", "img"), tag
        for name in ("src", "href", "xlink:href", "action", "data"):
            value = attrs.get(name)
            if value is not None and tag != "svg":
                assert value.startswith("#"), f"<{tag} {name}={value!r}>: not a local anchor"
    assert "url(http" not in html and "@import" not in html
    return page


def banner_code(page: Page) -> str | None:
    return next(a.get("data-exit-code") for t, a in page.tags if a.get("id") == "verdict")


# ------------------------------------------------------------------ a hand-built run
def _hand_run(root: Path) -> str:
    """Three closed-loop cells (c1, c2, c4) of 12 requests with server chains, steps,
    device rows and self-watch; one request failed with a server string that tries to
    inject a script; a warmup cell; secrets in plan.json and events.jsonl."""
    b = RunBuilder(root)
    k = itertools.count()
    for conc, cell in ((1, "p16-o5"), (2, "p16-o5"), (4, "p16-o5")):
        for i in range(12):
            n = next(k)
            t0 = n * 300 * MS
            rid = f"r{n:03d}"
            tpot = (8 + conc + (i % 5)) * MS
            err = i == 11 and conc == 4
            rec = request(
                rid,
                t0=t0,
                tpot=tpot,
                ttft=(40 + 3 * i) * MS,
                cell=cell,
                concurrency=conc,
                prompt_tokens=16 if conc < 4 else 2048,
                error="server_error_event" if err else None,
                ext={"error_detail": INJECTED} if err else None,
            )
            b.add(rec, tpot=tpot)
            if not err:
                a = t0 + 1 * MS
                steps = [(a + 2 * MS, a + 30 * MS, a + 31 * MS)]
                steps += [(a + (31 + j * 9) * MS, a + (39 + j * 9) * MS, a + (40 + j * 9) * MS)
                          for j in range(1, 5)]  # fmt: skip
                b.trace("server_events", server_chain(rid, accepted=a, steps=steps))
                b.trace("steps", [step_row(rid, j, h2d=0.1, wait=5.0, d2h=0.1, sampling=0.2)
                                  for j in range(5)])  # fmt: skip
    for i in range(3):
        b.add(
            request(f"w{i}", t0=(next(k)) * 300 * MS, cell="warmup:p16", quality={"warmup": True})
        )
    b.trace("device", [device_row(j * 500 * MS, (40.0 + j % 7, 41.0)) for j in range(40)])
    b.watch += [selfwatch("w00", j * 1000 * MS) for j in range(14)]
    b.complete_index()
    run = b.write()
    (root / "plan.json").write_text(json.dumps({
        "schema": "calculet-plan/v1", "seed": 0, "attempts": 1,
        "options": {"admin_token": SECRET, "matrix": "m.yaml"},
        "tables.cells": [{"name": "p16-o5", "repetitions": 12, "status": "done", "requests": 36,
                   "worker": "w00", "started_wall_ns": WALL0,
                   "ended_wall_ns": WALL0 + 40_000 * MS}],
        "excluded": [],
    }))  # fmt: skip
    (root / "events.jsonl").write_text(
        json.dumps({"wall_ns": 1_700_000_000_000_000_000, "step": "run", "status": "start",
                    "target": f"http://user:{SECRET}@host:1", "authorization": f"Bearer {SECRET}"})
        + "\n"
        + json.dumps({"wall_ns": 1_700_000_001_000_000_000, "step": "golden_before",
                      "status": "end", "failures": []})
        + "\n"
    )  # fmt: skip
    result = analyze(run)
    write_outputs(result, run)
    return run


@pytest.fixture(scope="module")
def hand(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    run = _hand_run(tmp_path_factory.mktemp("hand"))
    return run, Path(write_report(run)).read_text()


def test_the_report_is_one_self_contained_file(hand: tuple[str, str]) -> None:
    run, html = hand
    page = check_self_contained(html)
    assert Path(run, "report.html").exists()
    assert "Content-Security-Policy" in html and "default-src 'none'" in html
    assert len([t for t, _ in page.tags if t == "svg"]) >= 5


def test_banner_matches_verdict_json(hand: tuple[str, str]) -> None:
    run, html = hand
    doc = json.loads(Path(run, "verdict.json").read_text())
    assert doc["exit_code"] == 1  # the failed request: error_rate allows 0
    assert banner_code(Page(html)) == "1"
    assert "correctness / reliability fail" in html
    assert "error_rate" in Page(html).sections["verdicts"]


def test_every_cell_appears_with_its_n(hand: tuple[str, str]) -> None:
    run, html = hand
    doc = json.loads(Path(run, "verdict.json").read_text())
    rows = {(r[0], r[1]): r[2] for r in Page(html).tables["cells"]}
    assert len(doc["cells"]) == 4  # three measured cells and the warmup cell
    for c in doc["cells"]:
        assert rows[(c["cell"], c["partition"])] == f"{c['records']:,}"
    ttft = {(r[0], r[1]): r[2] for r in Page(html).tables["metric-ttft_ms"]}
    assert ttft[("p16-o5|c1|closed|stream", "measured")] == "12"
    assert ttft[("p16-o5|c4|closed|stream", "measured")] == "11"  # successes only


def test_percentiles_show_both_intervals_and_say_which_the_rules_read(
    hand: tuple[str, str],
) -> None:
    run, html = hand
    page = Page(html)
    p50 = {(r[0], r[1]): r[3] for r in page.tables["metric-ttft_ms"]}
    cell = p50[("p16-o5|c1|closed|stream", "measured")]
    # n = 12: the median has both intervals, "value [order statistic] boot [bootstrap]"
    assert re.fullmatch(r"\S+ \[\S+, \S+\] boot \[\S+, \S+\]", cell), cell
    assert "which the rules read" in page.sections["cells"]
    doc = json.loads(Path(run, "verdict.json").read_text())
    assert doc["methods"]["rules_percentile_interval"] == "quantile_ci"
    assert doc["methods"]["bootstrap_ci"].startswith("percentile bootstrap")


def test_slowest_requests_are_at_most_20_sorted_by_e2e(hand: tuple[str, str]) -> None:
    _, html = hand
    rows = Page(html).tables["slowest"]
    assert len(rows) == 20
    e2e = [float(r[6].replace(",", "")) for r in rows]
    assert e2e == sorted(e2e, reverse=True)
    assert [r[0] for r in rows] == [str(i) for i in range(1, 21)]
    assert all(r[3] == "measured" for r in rows)  # never a warmup request
    queue = float(rows[0][8])
    assert queue == pytest.approx(2.0, abs=1e-6)  # job_prepared − accepted: (a + 2) − a ms


def test_absent_data_says_no_data(hand: tuple[str, str]) -> None:
    _, html = hand
    page = Page(html)
    for section in ("comparison", "faults", "soak", "capacity"):
        text = page.sections[section]
        assert "no data in this run" in text, section
    assert not page.tables.get("capacity") and not page.tables.get("wins-losses")
    # the nav marks them too
    assert re.search(r'href="#faults">[^<]*</a> \(no data\)', html)


def test_server_strings_are_escaped_and_secrets_never_written(hand: tuple[str, str]) -> None:
    _, html = hand
    assert INJECTED not in html
    assert "&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt;" in html
    assert SECRET not in html
    assert "[redacted]" in html
    failed = Page(html).tables["nonsuccess"]
    assert failed[0][4] == "server_error_event" and failed[0][8] == INJECTED


def test_counter_example_sections_are_filled(hand: tuple[str, str]) -> None:
    _, html = hand
    page = Page(html)
    assert page.tables["nonsuccess-counts"] == [
        ["p16-o5|c4|closed|stream", "server_error_event", "1"]
    ]
    # c1 measured one prompt length only, so the curve takes every concurrency
    assert [r[0] for r in page.tables["longctx"]] == ["16", "2,048"]
    assert "at every concurrency" in page.sections["longctx"]
    assert page.tables["device-cells"]
    assert page.tables["selfwatch"][0][0] == "w00"
    assert {r[1] for r in page.tables["steps"]} == {"run", "golden_before"}
    assert "no data" not in page.sections["device"]


def test_a_folder_without_verdict_renders_a_banner_that_says_so(tmp_path: Path) -> None:
    b = RunBuilder(tmp_path / "run")
    b.add(request("r0", t0=0))
    run = b.write()
    html = render(build_view(run, baseline=str(tmp_path / "gone")))
    page = check_self_contained(html)
    assert banner_code(page) == ""
    assert "NO VERDICT" in html and "verdict.json is missing" in html
    assert "no data in this run" in page.sections["cells"]
    assert "baseline: " in page.sections["notes"] and "shown without it" in html


def test_labels_match_the_analysis_cell_keys() -> None:
    combos = [("a", 1, "closed", True), (None, None, "poisson", False), ("b", 8, None, None)]
    t = pa.table(
        {
            "ext.cell": [c[0] for c in combos],
            "workload.concurrency": pa.array([c[1] for c in combos], pa.int64()),
            "ext.arrival": [c[2] for c in combos],
            "workload.stream": pa.array([c[3] for c in combos], pa.bool_()),
        }
    )
    codes, labels = label_column(t)
    assert [labels[c] for c in codes] == [CellKey(*c).label for c in combos]


def test_cli_writes_the_report_and_exits_2_without_a_folder(
    hand: tuple[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run, _ = hand
    out = tmp_path / "r.html"
    assert main(["report", run, "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    check_self_contained(out.read_text())
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert "not a run folder" in capsys.readouterr().err


def test_templates_ship_with_the_package_and_the_cli_imports_light() -> None:
    from importlib.resources import files

    from calculet_drivers.cli import COMMANDS

    assert COMMANDS["report"][0::2] == ("analysis.report", "add_arguments")
    assert COMMANDS["report"][3] == "run"

    assert (files("analysis") / "templates" / "report.html.j2").is_file()
    pyproject = (REPO / "pyproject.toml").read_text()
    assert 'analysis = ["templates/*.html.j2"]' in pyproject
    code = (
        "import sys, analysis.report; "
        "print(sorted(m for m in ('matplotlib', 'jinja2', 'pyarrow', 'numpy', 'gevent', "
        "'locust') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ------------------------------------------------------------------ a real run + Chromium
@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    if not (CHROMIUM and CHROMEDRIVER):
        pytest.fail("chromium and chromedriver are needed: run scripts/setup as root")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = str(CHROMIUM)
    for arg in ("--headless", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1400,1000"):  # fmt: skip
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    service = Service(executable_path=str(CHROMEDRIVER), log_output=str(tmp_path / "driver.log"))
    driver = webdriver.Chrome(options=opts, service=service)
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()


@pytest.mark.timeout(180)
def test_a_real_acceptance_run_renders_a_report_chromium_opens(
    tmp_path: Path, browser: Any
) -> None:
    manifest = yaml.safe_load((REPO / "configs/manifest.sim.yaml").read_text())
    sim = SimProcess(
        tmp_path, "--time-scale", "0.02", "--set",
        f"versions.calbin_sha256={manifest['model']['calbin_sha256']}", faults=True,
    )  # fmt: skip
    try:
        manifest["target"]["url"] = sim.url
        manifest["warmup_requests"] = 2
        (tmp_path / "manifest.yaml").write_text(yaml.safe_dump(manifest))
        run = tmp_path / "run"
        env = {**os.environ, "CALCULET_ADMIN_TOKEN": ADMIN_TOKEN}
        env.pop("CALCULET_SIGNING_KEY", None)
        env.pop("CALCULET_SIGNING_KEY_FILE", None)
        proc = subprocess.run(
            [sys.executable, "-m", "calculet_drivers.cli", "accept", "--manifest",
             str(tmp_path / "manifest.yaml"), "--matrix", "configs/matrices/smoke.yaml",
             "--golden", "configs/golden/sim.yaml", "--run-dir", str(run),
             "--idle-window-s", "0.5", "--idle-gap-s", "0.1", "--min-repetitions", "6",
             "--quiet"],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=150,
        )  # fmt: skip
    finally:
        sim.stop()
    assert (run / "report.html").exists(), proc.stdout + proc.stderr
    doc = json.loads((run / "verdict.json").read_text())
    html = (run / "report.html").read_text()
    page = check_self_contained(html)
    steps = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    stopped = [s for s in steps if s["step"] == "run" and s["status"] == "stopped"]
    # the banner shows the pipeline's exit code: the verdict's, unless a step stopped it
    assert banner_code(page) == str(proc.returncode)
    assert stopped or banner_code(page) == str(doc["exit_code"])
    cells = {(r[0], r[1]): r[2] for r in page.tables["cells"]}
    for c in doc["cells"]:
        assert cells[(c["cell"], c["partition"])] == f"{c['records']:,}"
    slowest = page.tables["slowest"]
    assert 0 < len(slowest) <= 20
    e2e = [float(r[6].replace(",", "")) for r in slowest]
    assert e2e == sorted(e2e, reverse=True)
    # the pipeline's own log shows the report step, and the bundle signed after it lists it
    assert any(s["step"] == "report" and s["status"] == "end" for s in steps)
    bundle = json.loads((run / "bundle.intoto.json").read_text())
    assert bundle["signatures"] == []  # no key in the environment: marked unsigned
    assert "report.html" in base64.b64decode(bundle["payload"]).decode()
    assert "no data in this run" in page.sections["faults"]
    for sample in range(4):  # the corpus text of the prompts never reaches the report
        assert " ".join(sample_words(0, sample, 6)) not in html
    assert ADMIN_TOKEN not in html

    browser.get((run / "report.html").as_uri())
    assert doc["run"]["run_id"] in browser.title
    charts = browser.execute_script("return document.querySelectorAll('svg.plot').length")
    assert charts >= 5
    drawn = browser.execute_script(
        "return Array.from(document.querySelectorAll('svg.plot'))"
        ".filter(s => s.getBoundingClientRect().width > 100 && s.querySelector('path')).length"
    )
    assert drawn == charts
    banner = browser.find_element("id", "verdict")
    assert banner.get_attribute("data-exit-code") == str(doc["exit_code"])
    assert browser.execute_script("return performance.getEntriesByType('resource').length") == 0
    errors = [e for e in browser.get_log("browser") if e.get("level") == "SEVERE"]
    assert errors == []
    browser.save_screenshot(str(tmp_path / "report.png"))


REPORT_API = {
    "report": ["REPORT_NAME", "add_arguments", "build_view", "load_view", "render", "run",
               "write_report"],
    "views.model": ["DASH", "NO_DATA", "Banner", "Cell", "Figure", "ReportView", "RunView",
                  "Section", "Table", "cap_rows", "comparison_why", "figure", "fmt_ci", "fmt_int",
                  "fmt_ms", "fmt_num", "fmt_pct", "fmt_rel", "fmt_wall", "label_column",
                  "quantile_why", "spread_why", "table"],
    "tables.runfiles": ["LIFECYCLE_EVENTS", "RUNTIME_EVENTS", "BundleInfo", "RunFiles",
                        "ServerScan", "redact"],
    "views.plots": ["BreakdownBar", "Line", "Panel", "breakdown_bars", "cdf_figure", "curve_figure",
              "log_ticks", "scatter_curve", "shaded_scatter", "timeseries_figure"],
    "views.provenance": ["BANNER_RULES", "EXIT_MEANINGS", "banner", "plan_section",
                   "provenance_section", "signature_section", "verdicts_section"],
    "views.vendor": ["LEGACY_BANNER", "legacy_section", "vendor_section"],
    "views.endurance": ["endurance_section"],
    "views.conversations": ["SCATTER", "conversations_section"],
    "views.cells": ["METRIC_TITLES", "PRIMARY", "cdf_points", "cells_section",
                  "comparison_section", "measured_values", "short_warnings",
                  "summary_rows"],
    "views.counterexamples": ["BREAKDOWN", "SLOWEST", "excluded_section", "long_context_section",
                        "nonsuccess_section", "resets_section", "runtime_section",
                        "slowest_section"],
    "views.loadcurves": ["batch_section", "capacity_section", "curves_section", "offered_rates",
                   "shapes"],
    "views.timelines": ["MAX_POINTS", "bucket", "device_section", "faults_section", "run_window",
                  "selfwatch_section", "server_section", "soak_section"],
    "views.headline": ["MAX_CELLS", "headline_section"],
    "views.overtime": ["overtime_section", "read_series"],
}  # fmt: skip


def test_report_public_names_are_pinned_and_import_neither_locust_nor_gevent() -> None:
    import importlib

    for name, expected in REPORT_API.items():
        module = importlib.import_module(f"analysis.{name}")
        assert module.__all__ == expected, name
        assert all(hasattr(module, n) for n in module.__all__), name
    code = (
        f"import sys, {', '.join(f'analysis.{m}' for m in REPORT_API)}\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('locust', 'gevent'))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_bucket_keeps_the_peak_and_at_most_max_points() -> None:
    from analysis.views.timelines import bucket

    t = np.arange(100_000, dtype=np.float64)
    y = np.zeros(100_000)
    y[54_321] = 7.0  # one spike among 100,000 samples
    bt, by = bucket(t, y, 2000)
    assert len(bt) <= 2000 and by.max() == 7.0
    assert list(bt) == sorted(bt)


def test_cdf_points_keep_the_maximum_and_are_bounded() -> None:
    from analysis.views.cells import cdf_points

    v = np.random.default_rng(0).lognormal(size=1_000_000)
    x, f = cdf_points(v)
    assert len(x) <= 200 and x[-1] == v.max() and f[-1] == 1.0
    assert list(x) == sorted(x)
    small = np.array([3.0, 1.0, 2.0])
    assert [list(a) for a in cdf_points(small)] == [[1.0, 2.0, 3.0], [1 / 3, 2 / 3, 1.0]]


def test_redaction_of_credentials() -> None:
    from analysis.tables.runfiles import redact

    doc = {
        "admin_token": "abc",
        "nested": [{"Authorization": "Bearer xyz", "api-key": "k", "max_tokens": 32}],
        "url": "https://user:pw@host:8000/v1",
        "note": "sent Bearer zzz to the server",
        "token_hash": "h",
    }
    assert redact(doc) == {
        "admin_token": "[redacted]",
        "nested": [{"Authorization": "[redacted]", "api-key": "[redacted]", "max_tokens": 32}],
        "url": "https://[redacted]@host:8000/v1",
        "note": "sent Bearer [redacted] to the server",
        "token_hash": "h",
    }
