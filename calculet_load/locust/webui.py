"""The web UI's "LLM" tab, its controls and charts, and Locust's Edit dialog (Locust 2.4x
React UI).

Locust's stock bundle gives an extended tab a table only (`research/locust.md` §5.1-5.2):
its rows come from an `after_request` hook on `/stats/requests`, which the front end
polls every 2 s while a run goes on, and stops polling when it ends. So the page also
loads a small script of ours (`static/tab.js`, with uPlot vendored beside it: no CDN, the
machine may be offline) that puts into the tab, in place of that table:

- controls: set the open loop's rate, fire one burst of N now (the endpoints below; a
  refusal's message is shown in the tab);
- live charts of `GET /calculet/live?since=N`'s series (calculet_load.locust.series):
  TTFT, TPOT and ITL p50/p99, output tokens/s and requests in flight, each rate change and
  burst marked;
- the same figures table, polled in every state, so that after Stop the tab keeps the
  last run's figures (cancelled requests counted as cancelled) until the next start.

Endpoints:

    POST /calculet/rate   {"rate": 4.0}    new total arrival rate, from 0.5 s ahead
    POST /calculet/burst  {"size": 16}     fire a burst across all workers, --burst-lead ahead
    GET  /calculet/live[?since=SEQ]         the figures as JSON (with the series after SEQ)

Start and Edit both post Locust's form to `/swarm`. A start's custom parameters are
checked like the command line's before Locust applies them (a bad value is refused with
one line naming the option, the way Locust refuses a bad user count). An Edit while the
run goes on is read by calculet_load.locust.edit: what can change live is applied once
Locust accepted the Edit, what cannot is refused whole with a message.
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flask import Response, before_render_template, g, jsonify, request, send_from_directory
from locust.env import Environment

from calculet_load.locust.edit import flag, live_options, read_edit
from calculet_load.locust.livestats import LiveStats
from calculet_load.locust.llmreport import TAB_COLUMNS, html_section, inject, tab_rows
from calculet_load.locust.llmstats import LLMTable
from calculet_load.locust.options import form_value, number

log = logging.getLogger("calculet_load")

TAB = "calculet"
COLUMNS = TAB_COLUMNS
STATIC = Path(__file__).with_name("static")
STATIC_FILES = ("tab.js", "tab.css", "uPlot.iife.min.js", "uPlot.min.css", "uPlot.LICENSE")
# Locust's page loads these after its own bundle: relative, as its own assets are
PAGE_TAGS = (
    '<link rel="stylesheet" href="./calculet/static/uPlot.min.css">'
    '<link rel="stylesheet" href="./calculet/static/tab.css">'
    '<script src="./calculet/static/uPlot.iife.min.js"></script>'
    '<script src="./calculet/static/tab.js"></script>'
)
LIVE_STATES = ("spawning", "running")  # a /swarm then is an Edit


def install(
    env: Environment,
    coordinator: Callable[[], Any],
    live_stats: Callable[[], LiveStats | None],
    llm_table: Callable[[], LLMTable | None],
    option_problems: Callable[[Any], list[str]],
    ui_options: set[str],
) -> None:
    """The LLM tab, its rows, controls and series, the start form's check and Edit; the
    plugin passes what they read (its state), so nothing here imports the plugin."""
    ui = env.web_ui
    assert ui is not None and ui.app is not None
    app = ui.app
    ui.template_args["extended_tabs"] = [{"title": "LLM (calculet)", "key": TAB}]
    ui.template_args["extended_tables"] = [{"key": TAB, "structure": COLUMNS}]

    from calculet_load.locust.worker import OPEN_LOOP
    from calculet_load.locust.worker import options as _options

    options = _options(env)

    def running() -> bool:
        return env.runner is not None and env.runner.state in LIVE_STATES

    def live_now() -> tuple[str, ...]:
        plan = coordinator().plan
        arrival = plan.arrival if plan is not None else str(options.arrival)
        return live_options(arrival, arrival in OPEN_LOOP, env.shape_class is not None)

    @app.before_request
    def _check_swarm() -> Any:
        if request.method != "POST" or not request.path.endswith("/swarm"):
            return None
        check = _edit_problems if running() else _form_problems
        return ui.auth_required_if_enabled(check)()

    def _refuse(problems: list[str]) -> Any:
        # Locust's own answer to a bad form (200 + success false): the UI shows the message
        message = "calculet-load: " + "; ".join(problems)
        return jsonify({"success": False, "message": message, "host": env.host})

    def _form_problems() -> Any:
        trial = copy.copy(options)
        problems = []
        for key in sorted(ui_options & set(request.form)):
            value, problem = form_value(key, getattr(trial, key), request.form[key])
            if problem is not None:
                problems.append(problem)
            else:
                setattr(trial, key, value)
        problems = problems or option_problems(trial)
        return _refuse(problems) if problems else None

    def _edit_problems() -> Any:
        edit = read_edit(request.form, options, ui_options, live_now())
        if not edit.problems and edit.changes:
            trial = copy.copy(options)
            for key, value in edit.changes.items():
                setattr(trial, key, value)
            edit.problems += option_problems(trial)
        if edit.problems:
            return _refuse(edit.problems)
        g.calculet_edit = edit.changes  # applied once Locust accepted the Edit
        return None

    @before_render_template.connect_via(app)
    def _form_shows_the_run(_app: Any, template: Any, context: dict[str, Any], **_kw: Any) -> None:
        # Locust fills the form's custom parameters from the command line; the page shows
        # what the run uses (a start's form values, an Edit's), so an Edit opened from a
        # page loaded during the run sends the run's values back, not the command line's
        extra = (context.get("template_args") or {}).get("extra_options") or {}
        for key, spec in extra.items():
            value = getattr(options, key, None)
            if key in ui_options and isinstance(spec, dict) and _plain(value):
                spec["default_value"] = value

    def rows() -> list[dict[str, Any]]:
        t = llm_table()
        return tab_rows(t, live_stats()) if t is not None else []

    @app.after_request
    def _after(resp: Response) -> Response:
        path = request.path
        if path.endswith("/stats/requests") and resp.is_json:
            data = resp.get_json()
            data["extended_stats"] = [{"key": TAB, "data": rows()}]
            resp.set_data(json.dumps(data))
        elif path.endswith("/stats/report") and resp.status_code == 200:
            t = llm_table()  # the downloaded report carries the LLM section too
            if t is not None:
                resp.direct_passthrough = False
                resp.set_data(inject(resp.get_data(as_text=True), html_section(t)))
        elif path.endswith("/swarm") and "calculet_edit" in g and resp.is_json:
            if (resp.get_json() or {}).get("success"):
                for key, value in g.calculet_edit.items():
                    try:
                        coordinator().change_option(key, value)
                    except ValueError as exc:  # the run ended as the Edit came in
                        log.warning("calculet: Edit of %s not applied: %s", flag(key), exc)
        elif request.endpoint == "locust.index" and resp.status_code == 200:
            resp.direct_passthrough = False
            page = resp.get_data(as_text=True)
            at = page.rfind("</body>")
            if at >= 0:
                resp.set_data(page[:at] + PAGE_TAGS + page[at:])
        return resp

    @app.route("/calculet/static/<name>")
    def _static(name: str) -> Any:
        if name not in STATIC_FILES:
            return jsonify({"error": f"no such file: {name}"}), 404
        return send_from_directory(STATIC, name, max_age=0)

    def run_info() -> dict[str, Any] | None:
        c = coordinator()
        plan = c.plan
        if plan is None:
            return None
        live = live_now() if c.ended_wall_ns is None else ()
        return {
            "run_id": plan.run_id,
            "arrival": plan.arrival,
            "open_loop": plan.arrival in OPEN_LOOP,
            "rate": float(options.rate) if plan.arrival in OPEN_LOOP else None,
            "burst_size": int(options.burst_size),
            "burst_every": float(options.burst_every),
            "started_wall_ns": c.started_wall_ns,
            "ended_wall_ns": c.ended_wall_ns,
            "live_options": list(live),
            "fixed_options": sorted(ui_options - set(live)),
            # what the Edit dialog's fields should show: the options the run uses now
            "values": {k: v for k in sorted(ui_options) if _plain(v := getattr(options, k, None))},
        }

    @app.route("/calculet/live")
    @ui.auth_required_if_enabled
    def _live() -> Any:
        s = live_stats()
        c = coordinator()
        out: dict[str, Any] = {
            "rows": rows(),
            "counters": dict(s.counters) if s is not None else {},
            "errors": dict(s.errors) if s is not None else {},
            "state": env.runner.state if env.runner is not None else None,
            "run": run_info(),
            "columns": COLUMNS,
        }
        since = request.args.get("since")
        if since is not None:
            try:
                after = int(since)
            except ValueError:
                return jsonify({"error": "since: an integer is required"}), 400
            out.update(series=c.series.since(after), seq=c.series.seq, marks=c.marks())
        return jsonify(out)

    @app.route("/calculet/rate", methods=["POST"])
    @ui.auth_required_if_enabled
    def _rate() -> Any:
        rate, problem = number("rate", _body().get("rate"), "rate")
        if problem is not None or rate is None:
            return jsonify({"error": problem}), 400
        try:
            coordinator().change_rate(rate)
        except ValueError as exc:
            return jsonify({"error": str(exc)}), 409
        return jsonify({"rate": rate})

    @app.route("/calculet/burst", methods=["POST"])
    @ui.auth_required_if_enabled
    def _burst() -> Any:
        raw = _body().get("size", options.burst_size)
        size, problem = number("burst_size", raw, "size")
        if problem is not None or size is None:
            return jsonify({"error": problem}), 400
        try:
            msg = coordinator().fire_burst(int(size), float(options.burst_lead))
        except ValueError as exc:
            return jsonify({"error": str(exc)}), 409
        return jsonify({"id": msg["id"], "fire_at_wall_ns": msg["fire_at_wall_ns"]})


def _plain(value: Any) -> bool:
    """A value a form field shows as it is (not a list or an object)."""
    return value is None or isinstance(value, bool | int | float | str)


def _body() -> Any:
    """A control's fields: its JSON object, else its form."""
    body = request.get_json(silent=True)
    return body if isinstance(body, dict) else request.form
