"""Locust's Edit dialog on a running run (calculet_load.locust.edit): what may change
live in which run, and one line naming every parameter that cannot. In a browser:
tests/locust/test_webui.py."""

from __future__ import annotations

from types import SimpleNamespace

from calculet_load.locust.edit import live_options, read_edit

UI = {"arrival", "rate", "mix", "max_tokens", "burst_size", "burst_every", "no_stream"}


def _opts(**kw: object) -> SimpleNamespace:
    base = dict(arrival="constant", rate=4.0, mix="", max_tokens=32, burst_size=8,
                burst_every=0.0, no_stream=False)  # fmt: skip
    return SimpleNamespace(**{**base, **kw})


def _form(**kw: str) -> dict[str, str]:
    # the dialog sends every custom parameter as the form shows it (Locust's /swarm form)
    base = dict(user_count="3", spawn_rate="1", arrival="constant", rate="4", mix="",
                max_tokens="32", burst_size="8", burst_every="0", no_stream="false")  # fmt: skip
    return {**base, **kw}


def test_what_may_change_live_depends_on_the_run() -> None:
    assert live_options("poisson", True, False) == ("rate", "burst_size", "burst_lead")
    assert live_options("poisson", True, True) == ("burst_size", "burst_lead")  # --stages
    assert live_options("burst", False, False) == ("burst_size", "burst_every", "burst_lead")
    assert live_options("closed", False, False) == ("burst_size", "burst_lead")


def test_an_unchanged_form_changes_nothing_and_a_new_rate_is_a_live_change() -> None:
    live = live_options("constant", True, False)
    assert read_edit(_form(), _opts(), UI, live).changes == {}
    assert read_edit(_form(rate="4.0"), _opts(), UI, live).changes == {}  # the same number
    edit = read_edit(_form(rate="9", burst_size="16", user_count="10"), _opts(), UI, live)
    assert edit.changes == {"rate": 9.0, "burst_size": 16} and edit.problems == []


def test_a_fixed_parameter_refuses_the_whole_edit_naming_each() -> None:
    live = live_options("constant", True, False)
    edit = read_edit(
        _form(rate="9", arrival="poisson", mix="short-only", no_stream="true"), _opts(), UI, live
    )
    (problem,) = edit.problems
    assert problem == (
        "cannot change while the run goes on: --arrival (constant → poisson), "
        "--mix ('' → short-only), --no-stream (False → True); stop the run and start a new "
        "one for that (Edit changes --rate, --burst-size, --burst-lead live)"
    )
    closed = read_edit(_form(arrival="closed", rate="2"), _opts(arrival="closed"), UI,
                       live_options("closed", False, False))  # fmt: skip
    assert closed.problems == [
        "cannot change while the run goes on: --rate (4.0 → 2.0); stop the run and start a "
        "new one for that (Edit changes --burst-size, --burst-lead live)"
    ]


def test_a_value_of_the_wrong_type_is_named() -> None:
    edit = read_edit(_form(max_tokens="many"), _opts(), UI, ())
    assert edit.problems == ["--max-tokens must be a whole number >= 1 and <= 1048576, got 'many'"]
