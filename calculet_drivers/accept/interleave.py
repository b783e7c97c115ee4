"""`accept --interleave-with TARGET`: a baseline target's cells between the candidate's.

Two `Pipeline`s (accept.pipeline), the candidate's and the baseline's, driven step by
step in lockstep; the baseline's run folder is `RUN/baseline/`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from calculet_drivers.accept.pipeline import TRACES, Pipeline
from calculet_drivers.accept.plan import matrix_start, run_entry
from calculet_drivers.skeleton.steps import run_steps
from calculet_load.errors import EXIT_FAIL, EXIT_INVALID, EXIT_OK, RunStop


class Interleaved:
    """`--interleave-with TARGET`: the baseline's cells between the candidate's, in one run.

    Both targets get every step of §8 (release, idle, golden, warmup; golden after,
    resources, traces). The matrix runs in the one seeded order, each cell once on each
    target, alternating which goes first (ABBA: cell 1 candidate then baseline, cell 2
    baseline then candidate, …) so that neither build always meets the device or the
    client in the state the other left. The baseline is a complete run folder inside the
    candidate's (`baseline/`); the analysis compares the two and the candidate's bundle
    signs both.
    """

    def __init__(self, cand: Pipeline, base: Pipeline) -> None:
        self.cand, self.base = cand, base
        cand.label, base.label = " (candidate)", " (baseline)"
        cand.o.baseline_run = str(base.run_dir)
        base.o.workers, base.o.master = 0, False  # the candidate's workers send for both

    def _each(self, fn: Callable[[Pipeline], Any]) -> None:
        for p in (self.cand, self.base):
            try:
                fn(p)
            except RunStop as stop:
                raise RunStop(stop.code, f"{p.label.strip(' ()')}: {stop}") from None

    def run(self) -> int:
        cand, base = self.cand, self.base
        resumed = {id(cand): cand.open(), id(base): base.open()}
        try:
            self._each(lambda p: p.before_matrix(resumed[id(p)]))
            if cand.fleet is not None:
                base.fleet, base.clients, base.owns_fleet = cand.fleet, cand.fleet, False
            self._matrix()
            self._each(lambda p: p.after_matrix() if p is cand else p.golden_and_resources())
        except RunStop as stop:
            for p in (base, cand):
                p.stopped(stop)
        finally:
            base.close()  # first: it ends its run on the shared workers
            cand.close()
        if cand.code in (EXIT_OK, EXIT_FAIL):
            base.write_index()
            run_steps((TRACES,), base, base.log)
        base.log.write("run", "end", code=cand.code)
        return cand.end()

    def _matrix(self) -> None:
        cand, base = self.cand, self.base
        names = [e["name"] for e in cand.plan["cells"]]
        if [e["name"] for e in base.plan["cells"]] != names:
            raise RunStop(EXIT_INVALID, "interleave: the baseline's plan has another cell order")
        todo: dict[int, dict[str, dict[str, Any]]] = {}
        for p in (cand, base):
            todo[id(p)] = {e["name"]: e for e in matrix_start(p)}
        cand.plan["interleaved_with"] = {"run_dir": str(base.run_dir), "url": base.url}
        for n, name in enumerate(names):
            first_second = (cand, base) if n % 2 == 0 else (base, cand)
            for p in first_second:
                entry = todo[id(p)].get(name)
                if entry is not None:
                    entry["interleave_position"] = first_second.index(p)
                    try:
                        run_entry(p, entry, f"{n + 1}/{len(names)}")
                    except RunStop as stop:
                        raise RunStop(stop.code, f"{p.label.strip(' ()')}: {stop}") from None
        for p in (cand, base):
            p.log.write("matrix", "end")


def interleave_manifest(cand_manifest: str, target: str, folder: Path) -> str:
    """The baseline's manifest: TARGET itself when it is a manifest file; for a URL, the
    candidate's manifest with that target and the run id suffixed `-baseline` (its release
    check then expects the candidate's model hashes: give a manifest for another build)."""
    if Path(target).is_file():
        return target
    if not target.startswith(("http://", "https://")):
        raise RunStop(EXIT_INVALID, f"--interleave-with: {target!r} is neither a file nor a URL")
    import yaml

    doc = yaml.safe_load(Path(cand_manifest).read_text())
    doc["run_id"] = f"{doc['run_id']}-baseline"
    doc.setdefault("target", {})["url"] = target
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "manifest.given.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return str(path)
