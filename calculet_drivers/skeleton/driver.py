"""What every driver (accept, soak, the fault matrix, the capacity search) is made of
before its own steps: the manifest it runs under, its target, its run folder, its
progress lines, its notes and exit code, and the client it sends through."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from calculet_drivers.skeleton.folder import run_dir_for
from calculet_drivers.skeleton.progress import Progress
from calculet_drivers.skeleton.runclient import RunClient
from calculet_drivers.skeleton.runtarget import RunTarget
from calculet_load.errors import EXIT_INVALID, EXIT_OK, RunStop
from calculet_load.measure.session import Session
from calculet_load.schema.manifest import ManifestError, RunManifest, load_manifest

__all__ = ["Driver", "load_manifest_or_stop"]


def load_manifest_or_stop(path: str) -> RunManifest:
    try:
        return load_manifest(path)
    except ManifestError as exc:
        raise RunStop(EXIT_INVALID, str(exc)) from None


class Driver:
    """A driver's common state. `run_dir` defaults to `runs/<run_id><suffix>`; an
    invalid manifest or target raises RunStop (exit 2) before anything runs. `code` is
    the exit code so far, `notes` what the run ends by saying."""

    client: RunClient  # open_client's

    def __init__(
        self,
        manifest_path: str,
        *,
        url: str | None,
        run_dir: str | Path | None,
        suffix: str = "",
        progress: bool = True,
    ) -> None:
        self.manifest_path = manifest_path
        self.manifest = load_manifest_or_stop(manifest_path)
        self.target = RunTarget.of(self.manifest, url)
        self.url = self.target.url
        self.run_dir = run_dir_for(run_dir, self.manifest, suffix)
        self.say = Progress(progress)
        self.notes: list[str] = []
        self.code: int = EXIT_OK

    def open_client(
        self,
        worker: str,
        *,
        max_in_flight: int,
        folder: Path | None = None,
        make_session: Callable[..., Session] = Session,
    ) -> RunClient:
        """The run's client as `worker`, writing its parts under `folder` (the run
        folder); closed by `client.close()` when the run ends."""
        self.client = RunClient.open(
            self.manifest,
            self.target,
            folder or self.run_dir,
            worker,
            max_in_flight=max_in_flight,
            make_session=make_session,
        )
        return self.client
