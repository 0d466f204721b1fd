"""Ends an engine's processes when the process that owns them dies without stopping them.

vLLM runs its engine core (and its workers) in child processes. An owner that exits normally
stops them; an owner killed with SIGKILL does not, and Ray kills actors so when a job is
interrupted or its driver dies. The children then live on as orphans holding the model and its
KV cache, gigabytes each. A watchdog, a small child process of the owner in a session of its
own, waits for the owner to go, then sends SIGTERM to the processes it was given, and SIGKILL
to those still alive after a grace period.

`memstream serve` starts a private Ray instance whose processes are not all its children: the
raylet starts the dashboard and runtime-env agents, which outlive a killed raylet (the kernel
kills it when the driver dies; `ray.shutdown` when it is still there a second after its SIGTERM)
by 30 s and more. `start_descendants_watchdog` follows the owner's descendants while it lives,
and ends the ones it saw once the owner is gone; `end_processes` ends them from the owner itself.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Sequence

import psutil

GRACE_S = 5.0
WATCHDOG = """
import os, signal, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)
owner, grace, pids = int(sys.argv[1]), float(sys.argv[2]), [int(p) for p in sys.argv[3:]]
while os.getppid() == owner:
    time.sleep(0.5)
def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
for sig in (signal.SIGTERM, signal.SIGKILL):
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(map(alive, pids)):
        time.sleep(0.2)
"""


DESCENDANTS_WATCHDOG = """
import os, signal, sys, time
import psutil
signal.signal(signal.SIGINT, signal.SIG_IGN)
owner, grace = int(sys.argv[1]), float(sys.argv[2])
seen = {}
while os.getppid() == owner:
    try:
        found = psutil.Process(owner).children(recursive=True)
    except psutil.Error:
        found = []
    seen = {p.pid: p for p in seen.values() if p.is_running()}
    seen.update((p.pid, p) for p in found if p.pid != os.getpid())
    time.sleep(0.5)
def alive(process):
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
left = list(seen.values())
for end in (psutil.Process.terminate, psutil.Process.kill):
    for process in filter(alive, left):
        try:
            end(process)
        except psutil.Error:
            pass
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(map(alive, left)):
        time.sleep(0.2)
"""


def descendant_pids() -> list[int]:
    """The processes this one started, and theirs."""
    return [child.pid for child in psutil.Process().children(recursive=True)]


def start_watchdog(pids: Sequence[int], grace_s: float = GRACE_S) -> subprocess.Popen[bytes]:
    """Watches this process; once it is gone, ends `pids`. Terminate the watchdog when the
    processes were stopped the normal way."""
    command = [sys.executable, "-c", WATCHDOG, str(os.getpid()), str(grace_s), *map(str, pids)]
    return subprocess.Popen(
        command, stdin=subprocess.DEVNULL, close_fds=True, start_new_session=True
    )


def start_descendants_watchdog(grace_s: float = GRACE_S) -> subprocess.Popen[bytes]:
    """Watches this process, noting its descendants every half second while it lives (also those
    its children start, which a list of PIDs taken once would miss); once it is gone, ends the
    ones it saw, reparented or not. psutil refuses to signal a PID a new process has taken.
    Terminate the watchdog when the processes were stopped the normal way."""
    command = [sys.executable, "-c", DESCENDANTS_WATCHDOG, str(os.getpid()), str(grace_s)]
    return subprocess.Popen(
        command, stdin=subprocess.DEVNULL, close_fds=True, start_new_session=True
    )


def end_processes(processes: Sequence[psutil.Process], grace_s: float = GRACE_S) -> None:
    """SIGTERM to those of `processes` still running, then SIGKILL to those alive `grace_s`
    later. A process whose PID a new one has taken since is left alone (psutil checks)."""
    for end in (psutil.Process.terminate, psutil.Process.kill):
        for process in filter(_alive, processes):
            with contextlib.suppress(psutil.Error):  # it exited meanwhile
                end(process)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(map(_alive, processes)):
            time.sleep(0.1)


def _alive(process: psutil.Process) -> bool:
    """Running and not a zombie (an orphan's zombie waits for its new parent to reap it)."""
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
