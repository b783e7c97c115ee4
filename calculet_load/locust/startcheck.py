"""Before a Locust run's load starts (on the master, or the one local process): what kind
of server the target is, when `--target-profile` leaves it out, and one request that
shows it is there and streams (calculet_load.measure.preflight).

A wrong URL fails in seconds with one line naming it and the cause (exit 3), not at
`--run-time` after a run that measured nothing; a target that names no kind the harness
knows fails with one line naming `--target-profile` and its choices (exit 2).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from calculet_load.errors import ExitCode
from calculet_load.measure.preflight import preflight
from calculet_load.schema.access import AccessError, access_from
from calculet_load.schema.manifest import load_manifest
from calculet_load.schema.profiles import PROFILE_NAMES, profile_named
from calculet_load.target.describe import DetectError, detect_profile, model_for

log = logging.getLogger("calculet_load")


@dataclasses.dataclass(frozen=True)
class Refused:
    """Why the run does not start: one line, and the exit code."""

    line: str
    code: ExitCode


def check_target(opts: Any, host: str, sized: bool = True) -> Refused | None:
    """Settle `opts.target_profile` (detected when left out) and send the preflight;
    None when the run may start. `sized`: the run's users build exact-length prompts
    (the built-in user), so the target or a --tokenizer must be able to size them."""
    if not host:
        return Refused("calculet-load: no target: give -H/--host", ExitCode.INVALID_ARTIFACT)
    try:
        target = load_manifest(opts.manifest).target if opts.manifest else None
        access = access_from(opts, host, target)
    except AccessError as exc:
        return Refused(f"calculet-load: {exc}", ExitCode.INVALID_ARTIFACT)
    if opts.target_profile is None:
        try:
            name, why = detect_profile(access)
        except DetectError as exc:  # the request says best what is wrong with the target
            found = preflight(access, opts.protocol, opts.model or None)
            line = found.problem or f"the target {host} is not usable: {exc}"
            return Refused(f"calculet-load: {line}", ExitCode.INFRASTRUCTURE)
        except LookupError as exc:
            return Refused(
                f"calculet-load: cannot tell what kind of server {host} is ({exc}): give "
                f"--target-profile, one of {', '.join(PROFILE_NAMES)}",
                ExitCode.INVALID_ARTIFACT,
            )
        opts.target_profile = name
        log.info("calculet: the target %s is %s (%s)", host, name, why)
    profile = profile_named(opts.target_profile)
    try:
        model = model_for(access, profile, opts.protocol, opts.model or None)
    except OSError:
        model = opts.model or None  # the preflight says what is wrong with the target
    found = preflight(access, opts.protocol, model)
    if found.problem is not None:
        return Refused(f"calculet-load: {found.problem}", ExitCode.INFRASTRUCTURE)
    if sized and profile.chat_sizing == "local" and not opts.tokenizer:
        return Refused(
            f"calculet-load: the target {host} is {profile.name}, which cannot size prompts "
            "(no /tokenize): give --tokenizer FILE (the model's tokenizer.json)",
            ExitCode.INVALID_ARTIFACT,
        )
    if found.warning is not None:
        log.warning("calculet: %s; the run goes on", found.warning)
    return None
