"""Locust's Edit dialog on a running run: what may change live, and the plain refusal
of the rest.

Locust's web UI sends Edit as it sends Start: `POST /swarm` with the user count, the
spawn rate and every custom parameter of the form, at the values the form shows (its
"Custom parameters" section is there in both). Locust writes each into its parsed
options and goes on; a parameter the run read when it started would then change nothing,
silently. So calculet-load reads an Edit first (calculet_load.locust.webui):

- the options of `live_options` take effect at once (the open loop's rate, from 0.5 s
  ahead at the same schedule instant on every worker; the size, period and lead of the
  next bursts), and are recorded (the index's `plan.rate_changes`, `option_changes`);
- any other custom parameter whose value differs from the run's refuses the whole Edit,
  with one line naming each and what may change instead; nothing is applied.

The tab's script (static/tab.js) also disables the fixed fields in the dialog.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from calculet_load.locust.options import form_value

# what an Edit may change while a run goes on, and in which runs
LIVE_IN = {
    "rate": "open loop",  # the dispatchers' schedule is re-timed from a shared instant
    "burst_size": "any",  # the next burst's size (and the tab's default)
    "burst_every": "burst",  # the period of --arrival burst's bursts
    "burst_lead": "any",  # how far ahead the next burst is announced
}


def live_options(arrival: str, open_loop: bool, shaped: bool) -> tuple[str, ...]:
    """The options an Edit may change in this run: the rate in an open loop not driven
    by a load shape (`--stages` sets it stage by stage), the bursts' period in
    `--arrival burst`, the bursts' size and lead in any run (the tab fires bursts)."""
    out = []
    for name, where in LIVE_IN.items():
        if where == "open loop" and (not open_loop or shaped):
            continue
        if where == "burst" and arrival != "burst":
            continue
        out.append(name)
    return tuple(out)


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@dataclass
class Edit:
    """What an Edit asks: the live options it changes (typed), and why it is refused
    (empty: it is not)."""

    changes: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


def read_edit(
    form: Mapping[str, str], opts: Any, ui_options: Iterable[str], live: Iterable[str]
) -> Edit:
    """Compare the form's custom parameters with the run's options (`opts`, unchanged)."""
    edit = Edit()
    live = tuple(live)
    fixed = []
    for key in sorted(set(ui_options) & set(form)):
        current, text = getattr(opts, key, None), form[key]
        value, problem = form_value(key, current, text)
        if problem is not None:
            edit.problems.append(problem)
            continue
        if value == current:
            continue
        if key in live:
            edit.changes[key] = value
        else:
            fixed.append(f"{flag(key)} ({_shown(current)} → {_shown(value)})")
    if fixed:
        can = ", ".join(flag(k) for k in live) or "nothing of calculet's"
        edit.problems.append(
            f"cannot change while the run goes on: {', '.join(fixed)}; stop the run and "
            f"start a new one for that (Edit changes {can} live)"
        )
    return edit


def _shown(value: Any) -> str:
    return repr(value) if value == "" else str(value)
