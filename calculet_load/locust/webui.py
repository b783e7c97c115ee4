"""The web UI's "LLM" tab and its controls (Locust 2.4x React UI).

The tab is a table filled from the merged live figures; Locust's front end polls
`/stats/requests` every 2 s, and an `after_request` hook adds our rows to that answer
(`research/locust.md` §5.1). Two small endpoints change a running open-loop run:

    POST /calculet/rate   {"rate": 4.0}    new total arrival rate, from 0.5 s ahead
    POST /calculet/burst  {"size": 16}     fire a burst across all workers, 1 s ahead
    GET  /calculet/live                     the same figures as JSON

The start form's custom parameters are checked like the command line's before Locust
applies them: a bad value is refused with one line naming the option, the way Locust
refuses a bad user count, instead of starting a run that sends nothing.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

from flask import Response, jsonify, request
from locust.env import Environment

from calculet_load.locust.livestats import LiveStats
from calculet_load.locust.llmreport import TAB_COLUMNS, html_section, inject, tab_rows
from calculet_load.locust.llmstats import LLMTable
from calculet_load.locust.options import form_value, number

TAB = "calculet"
COLUMNS = TAB_COLUMNS


def install(
    env: Environment,
    coordinator: Callable[[], Any],
    live_stats: Callable[[], LiveStats | None],
    llm_table: Callable[[], LLMTable | None],
    option_problems: Callable[[Any], list[str]],
    ui_options: set[str],
) -> None:
    """The LLM tab, its rows and the start form's check; the plugin passes what they read
    (its state), so nothing here imports the plugin."""
    ui = env.web_ui
    assert ui is not None and ui.app is not None
    app = ui.app
    ui.template_args["extended_tabs"] = [{"title": "LLM (calculet)", "key": TAB}]
    ui.template_args["extended_tables"] = [{"key": TAB, "structure": COLUMNS}]

    from calculet_load.locust.worker import options as _options

    options = _options(env)

    @app.before_request
    def _check_start_form() -> Any:
        if request.method != "POST" or not request.path.endswith("/swarm"):
            return None
        return ui.auth_required_if_enabled(_form_problems)()

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
        if not problems:
            return None
        # Locust's own answer to a bad form (200 + success false): the UI shows the message
        message = "calculet-load: " + "; ".join(problems)
        return jsonify({"success": False, "message": message, "host": env.host})

    def stats() -> LiveStats | None:
        return live_stats()

    def table() -> LLMTable | None:
        return llm_table()

    def rows() -> list[dict[str, Any]]:
        t = table()
        return tab_rows(t, stats()) if t is not None else []

    @app.after_request
    def _add_rows(resp: Response) -> Response:
        if request.path.endswith("/stats/requests") and resp.is_json:
            data = resp.get_json()
            data["extended_stats"] = [{"key": TAB, "data": rows()}]
            resp.set_data(json.dumps(data))
        elif request.path.endswith("/stats/report") and resp.status_code == 200:
            t = table()  # the downloaded report carries the LLM section too
            if t is not None:
                resp.direct_passthrough = False
                resp.set_data(inject(resp.get_data(as_text=True), html_section(t)))
        return resp

    @app.route("/calculet/live")
    @ui.auth_required_if_enabled
    def _live() -> Any:
        s = stats()
        return jsonify(
            {
                "rows": rows(),
                "counters": dict(s.counters) if s is not None else {},
                "errors": dict(s.errors) if s is not None else {},
            }
        )

    @app.route("/calculet/rate", methods=["POST"])
    @ui.auth_required_if_enabled
    def _rate() -> Any:
        body = request.get_json(silent=True) or request.form
        rate, problem = number("rate", body.get("rate") if hasattr(body, "get") else None, "rate")
        if problem is not None or rate is None:
            return jsonify({"error": problem}), 400
        c = coordinator()
        try:
            c.change_rate(rate)
        except ValueError as exc:
            return jsonify({"error": str(exc)}), 409
        return jsonify({"rate": rate})

    @app.route("/calculet/burst", methods=["POST"])
    @ui.auth_required_if_enabled
    def _burst() -> Any:
        body = request.get_json(silent=True) or request.form
        raw = body.get("size", options.burst_size) if hasattr(body, "get") else None
        size, problem = number("burst_size", raw, "size")
        if problem is not None or size is None:
            return jsonify({"error": problem}), 400
        c = coordinator()
        try:
            msg = c.fire_burst(int(size), float(options.burst_lead))
        except ValueError as exc:
            return jsonify({"error": str(exc)}), 409
        return jsonify({"id": msg["id"], "fire_at_wall_ns": msg["fire_at_wall_ns"]})
