"""A fork server for the tests' simulators: `calculet-sim` started without paying for its
imports each time.

The suite starts about 160 simulators in its parallel phase, and each `python -m
calculet_sim.cli` spent 0.6 of its 0.7 s of CPU importing aiohttp, pydantic, yaml and
the simulator before it listened: on two cores, about 45 s of the phase's wall time.
This process imports `calculet_sim.cli` once; each start request forks it, and the child
runs `calculet_sim.cli.main(argv)` with the caller's environment, working directory,
stdout and stderr, as `python -m calculet_sim.cli` would. What a test sees is the same
process: its own pid (signals, psutil, the port's owner), its exit code, its output.

Protocol (tests.support.simproc is the client; one server per test process, on a
SOCK_SEQPACKET socket pair given as argv[1]): a request is one JSON message
{"argv", "env", "cwd"} carrying three descriptors (a status socket, stdout, stderr); the
answer is the child's pid. When the child ends, its exit code (Popen's: -N for a
signal) is written to its status socket. When the caller's end closes (the test
process is gone), every child is sent SIGTERM and the server exits.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import select
import signal
import socket
import sys
import traceback
from typing import Any

MAX_MESSAGE = 1 << 20


def _child(req: dict[str, Any], fds: list[int], closing: list[int], main: Any) -> None:
    """In the forked child: become `python -m calculet_sim.cli ARGV`; never returns."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in closing:
            with contextlib.suppress(OSError):
                os.close(fd)
        status, out, err = fds
        os.close(status)
        os.dup2(out, 1)
        os.dup2(err, 2)
        os.close(out)
        os.close(err)
        os.environ.clear()
        os.environ.update(req["env"])
        os.chdir(req["cwd"])
        sys.argv = ["calculet_sim.cli", *req["argv"]]
        code = main(req["argv"])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def serve(control: socket.socket) -> None:
    from calculet_sim.cli import main  # the imports every child shares

    gc.collect()
    gc.freeze()  # the imported heap stays shared with the children (copy-on-write)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: dict[int, socket.socket] = {}

    def reap() -> None:
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            sock = children.pop(pid, None)
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
                sock.close()

    while True:
        ready, _, _ = select.select([control, wake_r], [], [])
        if wake_r in ready:
            os.read(wake_r, 4096)
        reap()
        if control not in ready:
            continue
        msg, fds, _, _ = socket.recv_fds(control, MAX_MESSAGE, 3)
        if not msg:
            break
        req = json.loads(msg)
        closing = [control.fileno(), wake_r, wake_w, *(s.fileno() for s in children.values())]
        pid = os.fork()
        if pid == 0:
            _child(req, fds, closing, main)
        children[pid] = socket.socket(fileno=fds[0])
        os.close(fds[1])
        os.close(fds[2])
        control.sendall(f"{pid}\n".encode())
    for pid in list(children):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)


if __name__ == "__main__":
    serve(socket.socket(fileno=int(sys.argv[1])))
