"""Soak: `memstream serve` under mixed load from locust for minutes, on loopback.

Starts the real `memstream serve` process (a private Ray instance, Serve, the default engine:
SmolLM2-135M in vLLM; a SQLite job store; API keys required), a loopback web server holding the
documents its allowed URIs name, then locust (bench/soak_locustfile.py, headless, in its own
process) with `--users` concurrent users mixing sync answers (text, upload, allowed URI), async
jobs polled to their result, health checks and bad requests (oversized, invalid, forbidden URIs,
bad keys, hostile files, unknown jobs). It samples the resident memory (RSS) summed over the
server's process tree (the driver, Ray's processes, the Serve replicas, vLLM's EngineCore)
every few seconds.

Checks: no 5xx (503, backpressure, counts as handled), every request answered with the status
it expects, and the tree's RSS at the end within 10% of its RSS after the warm-up. Reported:
requests, statuses, p50 and p99 per route, the RSS samples. Results: bench/results/soak.{json,md}.

    make soak                                          # 5 minutes, the real engine
    .venv/bin/python bench/soak.py --minutes 1 --openai-stub   # develop: no model, 1 minute
    .venv/bin/python bench/soak.py --engine-config engine.yaml  # any `engine` section

`--engine-config` is a YAML file holding the serving config's `engine` section (its keys
override the soak's defaults), e.g. `{kind: openai, base_url: http://127.0.0.1:8010/v1}` for an
OpenAI-compatible server; `--openai-stub` starts bench/openai_stub.py and points the engine at
it (results then go to soak-stub.{json,md}, so they never pass for the real soak).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import psutil
import yaml

from connectors.engines.hardware import detect
from connectors.processes import ServerProcess, free_port, http_ok, start_memstream_serve

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
LOCUSTFILE = Path(__file__).with_name("soak_locustfile.py")
API_KEY = "soak-key-" + "3b9e1f7c5a2d4e6f8091"
MIB = 1 << 20
MODEL = "smollm2-135m-instruct"
# The engine section without --engine-config: the default packaged model, small and eager.
DEFAULT_ENGINE = {
    "model": MODEL,
    "max_model_len": 2048,
    "cpu_kvcache_space_gib": 1,
    "enforce_eager": True,
}
RSS_TOLERANCE = 0.10
BACKPRESSURE = 503
N_DOCUMENTS = 8

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@dataclass(frozen=True)
class SoakSettings:
    minutes: float = 5.0
    users: int = 16
    spawn_rate: float = 16.0
    warmup_s: float = 60.0
    sample_every_s: float = 5.0
    stop_timeout_s: float = 120.0  # for users to finish what they are doing when time is up
    max_body_bytes: int = 2 * MIB
    max_input_bytes: int = 1 * MIB
    chunk_size: int = 300
    max_memory_tokens: int = 24
    max_answer_tokens: int = 24


@dataclass(frozen=True)
class RssSample:
    t_s: float  # since the load started
    rss_bytes: int
    processes: int


def tree_rss(root: psutil.Process) -> tuple[int, list[psutil.Process]]:
    """The RSS summed over `root` and its descendants, and those processes."""
    total, found = 0, []
    for process in [root, *root.children(recursive=True)]:
        try:
            total += process.memory_info().rss
            found.append(process)
        except psutil.Error:  # it exited while we looked
            continue
    return total, found


class RssSampler:
    """Samples the process tree's RSS every `every_s` seconds in a thread, from `start()`."""

    def __init__(self, root_pid: int, every_s: float) -> None:
        self.root = psutil.Process(root_pid)
        self.every_s = every_s
        self.samples: list[RssSample] = []
        self.seen: dict[int, str] = {}  # every process of the tree, for the leftovers check
        self._started = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._started = time.monotonic()
        self._thread.start()

    def sample(self) -> RssSample:
        rss, processes = tree_rss(self.root)
        for process in processes:
            try:
                self.seen.setdefault(process.pid, process.name())
            except psutil.Error:
                continue
        found = RssSample(round(time.monotonic() - self._started, 1), rss, len(processes))
        self.samples.append(found)
        return found

    def stop(self) -> RssSample:
        self._stop.set()
        self._thread.join()
        return self.sample()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.sample()

    def after(self, t_s: float) -> RssSample:
        """The first sample taken at `t_s` or later (the last one if none is)."""
        return next((s for s in self.samples if s.t_s >= t_s), self.samples[-1])


class QuietFiles(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


@contextmanager
def document_site(folder: Path) -> Iterator[str]:
    """The soak's documents on a loopback web server; yields the URI prefix they are under."""
    docs = folder / "docs"
    docs.mkdir()
    for index in range(N_DOCUMENTS):
        (docs / f"record-{index}.txt").write_text(
            f"Record {index}. The shipment of record {index} left the depot on time. "
            f"The code word of record {index} is WORD{index:05d}. Nothing else happened."
        )
    server = ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(QuietFiles, directory=str(folder))
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/docs/"
    finally:
        server.shutdown()
        server.server_close()


@contextmanager
def openai_stub(folder: Path) -> Iterator[dict[str, Any]]:
    """bench/openai_stub.py on a free port; yields the engine section that points at it."""
    port = free_port()
    command = [sys.executable, str(REPO / "bench" / "openai_stub.py"), "--port", str(port),
               "--model", MODEL]  # fmt: skip
    stub = ServerProcess(command, folder / "openai-stub.log", cwd=REPO, env=python_env())
    try:
        stub.wait_until(http_ok(f"http://127.0.0.1:{port}/v1/models"), "the OpenAI stub")
        yield {"kind": "openai", "model": MODEL, "base_url": f"http://127.0.0.1:{port}/v1"}
    finally:
        stub.stop()


def python_env() -> dict[str, str]:
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{path}" if path else str(REPO)}


def serve_config(
    settings: SoakSettings, engine: dict[str, Any], docs: str, folder: Path
) -> dict[str, Any]:
    from serving.config import config_from_mapping

    config = {
        "server": {"host": "127.0.0.1", "port": free_port()},
        "ray": {"num_cpus": 2, "object_store_memory_mib": 256},
        "engine": {**DEFAULT_ENGINE, **engine},
        "method": {
            "chunk_size": settings.chunk_size,
            "max_memory_tokens": settings.max_memory_tokens,
            "max_answer_tokens": settings.max_answer_tokens,
        },
        "store": {"url": f"sqlite:///{folder / 'serving.db'}"},
        "limits": {
            "max_body_bytes": settings.max_body_bytes,
            "max_input_bytes": settings.max_input_bytes,
        },
        "uris": {"allowed_prefixes": [docs], "allowed_networks": ["127.0.0.0/8"]},
        "auth": {"require_keys": True},
    }
    config_from_mapping(config)  # refused here, with the key's path, rather than in the server
    return config


def run_locust(
    settings: SoakSettings, url: str, docs: str, folder: Path, sampler: RssSampler
) -> tuple[dict[str, Any], int]:
    """Runs the load to its end; locust's stats with the statuses by route, and its exit code."""
    stats_path = folder / "locust-stats.json"
    env = {
        **python_env(),
        "SOAK_API_KEY": API_KEY,
        "SOAK_DOCS": docs,
        "SOAK_DOCUMENTS": str(N_DOCUMENTS),
        "SOAK_MAX_BODY_BYTES": str(settings.max_body_bytes),
        "SOAK_MAX_INPUT_BYTES": str(settings.max_input_bytes),
        "SOAK_STATS": str(stats_path),
    }
    command = [
        sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless",
        "--users", str(settings.users), "--spawn-rate", str(settings.spawn_rate),
        "--run-time", f"{round(settings.minutes * 60)}s",
        "--stop-timeout", f"{round(settings.stop_timeout_s)}", "--host", url,
        "--only-summary", "--loglevel", "WARNING",
    ]  # fmt: skip
    with (folder / "locust.log").open("wb") as log:
        locust = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        sampler.start()
        code = locust.wait()
    return json.loads(stats_path.read_text()), code


def summarize(
    settings: SoakSettings,
    stats: dict[str, Any],
    sampler: RssSampler,
    idle_rss: int,
    end: RssSample,
) -> dict[str, Any]:
    routes = stats["routes"]
    server_errors = {
        route: {code: n for code, n in row["statuses"].items() if is_server_error(int(code))}
        for route, row in routes.items()
    }
    server_errors = {route: codes for route, codes in server_errors.items() if codes}
    unexpected = {route: row["failures"] for route, row in routes.items() if row["failures"]}
    warm = sampler.after(settings.warmup_s)
    change = end.rss_bytes / warm.rss_bytes - 1
    return {
        "requests": sum(row["requests"] for row in routes.values()),
        "backpressure_503": sum(row["statuses"].get("503", 0) for row in routes.values()),
        "checks": {
            "zero_5xx": not server_errors,
            "expected_statuses": not unexpected,
            "rss_within_10_percent": abs(change) <= RSS_TOLERANCE,
        },
        "server_errors": server_errors,
        "unexpected_statuses": unexpected,
        "failures": stats["failures"],
        "rss": {
            "idle_bytes": idle_rss,
            "after_warmup_bytes": warm.rss_bytes,
            "after_warmup_t_s": warm.t_s,
            "end_bytes": end.rss_bytes,
            "end_t_s": end.t_s,
            "peak_bytes": max(s.rss_bytes for s in sampler.samples),
            "change": round(change, 4),
            "samples": [asdict(s) for s in sampler.samples],
        },
        "routes": routes,
    }


def is_server_error(status: int) -> bool:
    """A 5xx other than backpressure, or no response at all (status 0)."""
    return status == 0 or (status >= 500 and status != BACKPRESSURE)


def leftovers(sampler: RssSampler) -> list[dict[str, Any]]:
    """Processes of the server's tree still alive after it stopped: ended here by their PID."""
    left = []
    for pid, name in sampler.seen.items():
        try:
            process = psutil.Process(pid)
            if process.name() != name or process.status() == psutil.STATUS_ZOMBIE:
                continue  # gone (its PID may be another process's now)
            left.append({"pid": pid, "name": name})
            process.kill()
        except psutil.Error:
            continue
    return left


def markdown(report: dict[str, Any]) -> str:
    settings, result, engine = report["settings"], report["result"], report["engine"]
    rss = result["rss"]
    checks = result["checks"]

    def verdict(ok: bool) -> str:
        return "pass" if ok else "**FAIL**"

    engine_name = engine.get("kind", "vllm") + ": " + str(engine.get("model"))
    lines = [
        "# Soak: `memstream serve` under mixed load (locust)",
        "",
        f"{settings['minutes']:g} minutes, {settings['users']} concurrent users on 127.0.0.1, "
        f"engine {engine_name}"
        + (" (**a stub, not a model: a development run, not the soak**)" if report["stub"] else "")
        + f"; chunk {settings['chunk_size']} tokens, memory/answer "
        f"{settings['max_memory_tokens']}/{settings['max_answer_tokens']} tokens. Serve "
        f"start-up {report['serve_startup_s']} s. {report['machine']['cpu']}, load "
        f"average {report['machine']['load_average']} before, "
        f"{report['machine']['load_average_end']} at the end (the soak's own processes "
        f"included). {result['requests']} requests, {result['backpressure_503']} answered 503 "
        "(backpressure, handled).",
        "",
        "| check | result |",
        "|---|---|",
        f"| no 5xx but 503 (and every request answered) | {verdict(checks['zero_5xx'])} |",
        f"| every request got the status it expects | {verdict(checks['expected_statuses'])} |",
        f"| RSS at the end within 10% of RSS after warm-up | "
        f"{verdict(checks['rss_within_10_percent'])} ({rss['change']:+.1%}) |",
        "",
        f"RSS of the server's process tree ({rss['samples'][-1]['processes']} processes at the "
        f"end): idle {mib(rss['idle_bytes'])}, after warm-up ({rss['after_warmup_t_s']:g} s) "
        f"{mib(rss['after_warmup_bytes'])}, at the end ({rss['end_t_s']:g} s) "
        f"{mib(rss['end_bytes'])}, peak {mib(rss['peak_bytes'])}.",
        "",
        "| route | requests | statuses | p50 ms | p99 ms | max ms |",
        "|---|---:|---|---:|---:|---:|",
    ]
    for route, row in result["routes"].items():
        codes = ", ".join(f"{code}: {n}" for code, n in row["statuses"].items())
        lines.append(
            f"| {route} | {row['requests']} | {codes} | {row['p50_ms']:.0f} | "
            f"{row['p99_ms']:.0f} | {row['max_ms']:.0f} |"
        )
    if result["server_errors"]:
        lines += ["", f"5xx by route: {json.dumps(result['server_errors'])}."]
    if result["failures"]:
        lines += ["", "Unexpected responses:", ""]
        lines += [f"- {f['route']}: {f['error']} ({f['occurrences']}x)" for f in result["failures"]]
    left = report["left_behind"]
    lines += [
        "",
        "Processes of the server's tree alive after its SIGTERM (and SIGKILL 180 s later): "
        + (", ".join(f"{p['name']} ({p['pid']})" for p in left) if left else "none")
        + ".",
        "",
    ]
    return "\n".join(lines)


def mib(n_bytes: int) -> str:
    return f"{n_bytes / MIB:,.0f} MiB"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=SoakSettings.minutes)
    parser.add_argument("--users", type=int, default=SoakSettings.users)
    parser.add_argument("--warmup-s", type=float, help="default: a fifth of the run, at most 60 s")
    engine_group = parser.add_mutually_exclusive_group()
    engine_group.add_argument(
        "--engine-config", type=Path, help="YAML: the serving config's `engine` section"
    )
    engine_group.add_argument(
        "--openai-stub", action="store_true", help="drive a local OpenAI-compatible stub"
    )
    parser.add_argument("--output", help="results name in bench/results (default: soak)")
    args = parser.parse_args(argv)
    warmup_s = args.warmup_s if args.warmup_s is not None else min(60.0, args.minutes * 12)
    settings = SoakSettings(
        minutes=args.minutes, users=args.users, spawn_rate=args.users, warmup_s=warmup_s
    )
    output = args.output or ("soak-stub" if args.openai_stub else "soak")
    report: dict[str, Any] = {
        "settings": asdict(settings),
        "stub": args.openai_stub,
        "machine": {
            "cpu": detect().describe(),
            "cpus": os.cpu_count(),
            "load_average": [round(x, 2) for x in os.getloadavg()],
            "python": platform.python_version(),
        },
    }
    folder = Path(tempfile.mkdtemp(prefix="memstream-soak-", dir="/tmp"))
    try:
        code = soak(args, settings, folder, report)
    except BaseException:
        print(f"soak: logs kept in {folder}", file=sys.stderr)
        raise
    report["machine"]["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{output}.json").write_text(json.dumps(report, indent=2) + "\n")
    table = markdown(report)
    (RESULTS / f"{output}.md").write_text(table)
    print(table)
    passed = all(report["result"]["checks"].values())
    if passed and code == 0:
        shutil.rmtree(folder, ignore_errors=True)
    else:
        print(f"soak: logs kept in {folder}", file=sys.stderr)
    return 0 if passed else 1


def soak(
    args: argparse.Namespace, settings: SoakSettings, folder: Path, report: dict[str, Any]
) -> int:
    """Runs the soak into `report`; locust's exit code (1 when a request failed its check)."""
    with document_site(folder) as docs:
        engine_section = (
            openai_stub(folder) if args.openai_stub else _given_engine(args.engine_config)
        )
        with engine_section as engine:
            config = serve_config(settings, engine, docs, folder)
            report["engine"] = config["engine"]
            server, url, startup_s = start_memstream_serve(config, folder, API_KEY, python_env())
            report["serve_startup_s"] = round(startup_s, 1)
            sampler = RssSampler(server.process.pid, settings.sample_every_s)
            try:
                idle_rss, _ = tree_rss(sampler.root)  # before the load
                stats, code = run_locust(settings, url, docs, folder, sampler)
                end = sampler.stop()
            finally:
                server.stop(grace=180)
            time.sleep(2)  # let the tree's last processes exit before looking
            report["left_behind"] = leftovers(sampler)
    report["result"] = summarize(settings, stats, sampler, idle_rss, end)
    return code


@contextmanager
def _given_engine(path: Path | None) -> Iterator[dict[str, Any]]:
    if path is None:
        yield {}
        return
    section = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    if not isinstance(section, dict):
        raise SystemExit(f"{path}: expected a mapping (the serving config's engine section)")
    yield section


if __name__ == "__main__":
    sys.exit(main())
