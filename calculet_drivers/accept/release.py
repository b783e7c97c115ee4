"""Step 1 of the acceptance run: the release under test is the one the manifest names
(spec §8.1): the calbin file's hash, what the target serves (through its admin API) and,
for a batch matrix, the vendor's statement of how lanes that are not filled are handled."""

from __future__ import annotations

import hashlib
from typing import Any

from calculet_drivers.accept.acceptrun import AcceptRun
from calculet_drivers.skeleton.steps import StepResult
from calculet_load.errors import EXIT_INVALID, RunStop
from calculet_load.schema.manifest import RunManifest
from calculet_load.target.api import off_loop
from calculet_load.target.describe import describe_target
from calculet_load.workload.matrix import Matrix

__all__ = ["release"]


def release(run: AcceptRun) -> StepResult:
    m = run.manifest.model
    checked = []
    if run.o.calbin:
        digest = _sha256_file(run.o.calbin)
        if digest != m.calbin_sha256:
            raise RunStop(
                EXIT_INVALID,
                f"release: calbin {run.o.calbin} sha256 {digest[:12]}… != manifest "
                f"model.calbin_sha256 {m.calbin_sha256[:12]}…",
            )
        checked.append("calbin file")
    run.target.require("release: ")
    # what the target says of itself (model list, /props or version, Server header)
    described = off_loop(lambda: describe_target(run.target.access, run.target.profile))
    state: Any = None
    if run.o.admin_token:
        try:
            state = run.api.state()
        except OSError as exc:
            raise RunStop(EXIT_INVALID, f"release: {exc}") from None
        served = state.get("calbin_sha256")
        if served != m.calbin_sha256:
            raise RunStop(
                EXIT_INVALID,
                f"release: the target serves calbin {str(served)[:12]}… but the manifest "
                f"says model.calbin_sha256 {m.calbin_sha256[:12]}…",
            )
        if state.get("generation") is not None and state["generation"] != m.generation:
            raise RunStop(
                EXIT_INVALID,
                f"release: the target is at generation {state['generation']}, the "
                f"manifest says model.generation {m.generation}",
            )
        checked.append("served calbin and generation")
    else:
        run.notes.append("release: no admin token, the served calbin was not checked")
    batch = release_batch(run.matrix, run.manifest, state)
    if batch is not None and batch["served_compiled_batch"] is not None:
        checked.append("served compiled batch")
    run.say(f"release verified ({', '.join(checked) or 'manifest only'})")
    run.rtt.take("before")
    return StepResult.ok(checked=checked, health="ok", batch=batch, target=described)


def release_batch(matrix: Matrix, manifest: RunManifest, state: Any) -> dict[str, Any] | None:
    """Spec §7 at release: a batch matrix (`compiled_batch: B`) needs the vendor's
    statement of how lanes that are not filled are handled (manifest `batch`) for the same
    B, served by the target when its /admin/state says (exit 2 otherwise). Returns what
    the release `end` event records (None: neither the matrix nor the manifest has one)."""
    want, stated = matrix.compiled_batch, manifest.batch
    if want is not None and stated is None:
        raise RunStop(
            EXIT_INVALID,
            f"release: manifest batch.partial_lanes missing: matrix {matrix.name} measures "
            f"compiled batch B{want}, and spec §7 requires the vendor to state how lanes "
            "that are not filled are handled (masked/padded) in the manifest's batch section",
        )
    if stated is None:
        return None
    if want is not None and stated.compiled_batch != want:
        raise RunStop(
            EXIT_INVALID,
            f"release: manifest batch.compiled_batch {stated.compiled_batch} != matrix "
            f"{matrix.name} compiled_batch {want}",
        )
    block = state.get("batch") if isinstance(state, dict) else None
    served = block.get("compiled_batch") if isinstance(block, dict) else None
    if served is not None and served != stated.compiled_batch:
        raise RunStop(
            EXIT_INVALID,
            f"release: the target serves compiled batch {served} (/admin/state batch."
            f"compiled_batch) but the manifest says batch.compiled_batch "
            f"{stated.compiled_batch}",
        )
    return {
        **stated.model_dump(),
        "matrix_compiled_batch": want,
        "served_compiled_batch": served,
        "served_partial_lanes": block.get("partial_lanes") if isinstance(block, dict) else None,
    }


def _sha256_file(path: str) -> str:
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    except OSError as exc:
        raise RunStop(EXIT_INVALID, f"release: calbin {path}: {exc.strerror}") from None
    return h.hexdigest()
