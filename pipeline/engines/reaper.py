"""Ends an engine's processes when the process that owns them dies without stopping them.

vLLM runs its engine core (and its workers) in child processes. An owner that exits normally
stops them; an owner killed with SIGKILL does not, and Ray kills actors so when a job is
interrupted or its driver dies. The children then live on as orphans holding the model and its
KV cache, gigabytes each. A watchdog, a small child process of the owner in a session of its
own, waits for the owner to go, then sends SIGTERM to the processes it was given, and SIGKILL
to those still alive after a grace period.
"""

from __future__ import annotations

import os
import subprocess
import sys
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
