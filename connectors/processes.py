"""Servers as child processes: started in their own session with their output in a log file,
ready once a probe passes, stopped by their PID. `memstream serve` for benchmarks and tests that
want a private endpoint; S3 and vLLM servers for tests and benchmarks."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from connectors.engines.reaper import start_watchdog

REPO = Path(__file__).resolve().parents[1]


class ServerNotReady(RuntimeError):
    """The server exited or did not become ready in time; the message ends with its log."""


def free_port() -> int:
    """A TCP port free on the loopback interface right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def http_ok(url: str) -> Callable[[], bool]:
    """A readiness probe: GET `url` answers 200."""

    def ready() -> bool:
        try:
            return httpx.get(url, timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    return ready


class ServerProcess:
    """A server started in its own session, its output in a log file, stopped by its PID; and
    by a watchdog if the test process is killed (SIGKILL) before it could stop the server."""

    def __init__(
        self,
        command: Sequence[str],
        log: Path,
        *,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> None:
        self.log = log
        with log.open("wb") as output:
            self.process = subprocess.Popen(
                list(command),
                stdout=output,
                stderr=subprocess.STDOUT,
                env=None if env is None else dict(env),
                cwd=cwd,
                start_new_session=True,
            )
        self._watchdog = start_watchdog([self.process.pid])

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def wait_until(self, ready: Callable[[], bool], name: str, timeout: float = 90) -> float:
        """Seconds until `ready()` held; `ServerNotReady` if the server exits or time runs out."""
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            if self.process.poll() is not None:
                raise ServerNotReady(
                    f"{name} exited ({self.process.returncode}):\n{self.log_tail()}"
                )
            if ready():
                return time.monotonic() - started
            time.sleep(0.2)
        raise ServerNotReady(f"{name} not ready after {timeout:.0f} s:\n{self.log_tail()}")

    def stop(self, grace: float = 3) -> None:
        """SIGTERM, then SIGKILL after `grace` seconds."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._watchdog.terminate()
        self._watchdog.wait()


def start_memstream_serve(
    config: Mapping[str, Any],
    folder: Path,
    api_key: str,
    env: Mapping[str, str] | None = None,
    timeout: float = 900,
) -> tuple[ServerProcess, str, float]:
    """`python -m serving.cli serve` with `config` (written to folder/serve.yaml; its server is
    on loopback) and `api_key`, ready once /healthz answers: the process, its URL, start-up s."""
    path = folder / "serve.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    environment = {**(os.environ if env is None else env), "MEMSTREAM_API_KEYS": api_key}
    environment.pop("RAY_ADDRESS", None)
    command = [sys.executable, "-m", "serving.cli", "serve", "--config", str(path)]
    server = ServerProcess(command, folder / "serve.log", env=environment, cwd=REPO)
    url = f"http://127.0.0.1:{config['server']['port']}"
    try:
        startup_s = server.wait_until(http_ok(f"{url}/healthz"), "memstream serve", timeout)
    except ServerNotReady:
        server.stop(grace=180)
        raise
    return server, url, startup_s
