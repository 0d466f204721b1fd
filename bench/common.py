"""Shared bits of the benchmarks: a mixed-length corpus of real text, the options and engine
settings they share, a process-tree memory sampler, Markdown tables and result writers."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import threading
import time
from collections.abc import AsyncIterator, Hashable, Iterable, Sequence
from pathlib import Path
from typing import Any, Self, TypeVar

import psutil

from connectors.engines import models
from connectors.engines.factory import EngineSpec, open_engine
from connectors.engines.hardware import DTYPES, detect, resolve_dtype
from connectors.engines.vllm_local import VLLMEngine, VLLMEngineConfig
from operators.config import MethodConfig
from operators.core.chain import ChainStatus, MemoryChain
from operators.engine import Completion, GenerationRequest, SamplingConfig
from operators.runner import ChainResult, ChainRunner

REPO = Path(__file__).resolve().parents[1]
CORPORA = REPO.parent / "shared" / "corpora"
# $MEMSTREAM_BENCH_RESULTS sends a run's tables elsewhere (bench/gpu_check.sh: a temporary
# folder, so the measured CPU results stay as they are).
RESULTS = Path(os.environ.get("MEMSTREAM_BENCH_RESULTS") or REPO / "bench" / "results")
DEFAULT_MODEL = "smollm2-135m-instruct"
# How this project runs an AVX-512 CPU as an AVX2-only one (docs/performance.md)
ISA_LIMITS = ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")

Key = TypeVar("Key", bound=Hashable)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def real_text(min_chars: int) -> str:
    """Concatenated real long texts (RFC 2616 and two Gutenberg books), repeated if needed."""
    parts = [
        (CORPORA / "text" / name).read_text(encoding="utf-8-sig")
        for name in (
            "rfc2616-http-1.1.txt",
            "gutenberg-1661-adventures-of-sherlock-holmes.txt",
            "gutenberg-1342-pride-and-prejudice.txt",
        )
    ]
    text = "\n".join(parts)
    while len(text) < min_chars:
        text += "\n" + text
    return text


def documents_of_lengths(tokenizer: Any, lengths: list[int]) -> list[tuple[str, str]]:
    """(doc_id, text) pairs cut from real text at exact token lengths, from different offsets."""
    text = real_text(sum(lengths) * 6)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    documents, offset = [], 0
    for index, length in enumerate(lengths):
        documents.append((f"doc{index}-{length}", tokenizer.decode(ids[offset : offset + length])))
        offset += length
    return documents


def write_results(
    name: str, payload: dict[str, Any], markdown: str, *, measured_here: bool = True
) -> None:
    """`name`.json and `name`.md in RESULTS, both dated and naming the machine that ran them;
    a table built from saved runs (`measured_here=False`) names its cells' machines itself."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    machine = detect().describe()
    emulation = {limit: os.environ[limit] for limit in ISA_LIMITS if os.environ.get(limit)}
    if emulation:  # the CPU's flags stay as they are; its kernels are held to an older ISA
        machine += ", kernels limited by " + " ".join(f"{k}={v}" for k, v in emulation.items())
    date = time.strftime("%Y-%m-%dT%H:%M:%S")
    payload = {"benchmark": name, "date": date, "machine": machine, **payload}
    when = date.replace("T", " ")
    if measured_here:
        markdown = f"{markdown}\n\nMeasured on {machine}, {when}."
    else:
        payload = {**payload, "machine": "see each cell"}
        markdown = f"{markdown}\n\nBuilt from saved runs, {when}."
    (RESULTS / f"{name}.json").write_text(json.dumps(payload, indent=2) + "\n")
    (RESULTS / f"{name}.md").write_text(markdown + "\n")
    print(markdown)


async def replay_prompts(
    spec: EngineSpec, prompts: dict[Key, str], max_tokens: int, sampling: SamplingConfig
) -> dict[Key, Completion]:
    """Each prompt answered on one engine, one at a time (the CPU engine has no spare core)."""
    engine = open_engine(spec)
    replies = {}
    try:
        for key, prompt in prompts.items():
            request = GenerationRequest(str(key), prompt, max_tokens, sampling)
            replies[key] = await engine.generate(request)
            print(key, repr(replies[key].text[-120:]), flush=True)
    finally:
        await engine.shutdown()
    return replies


def bench_parser(doc: str) -> argparse.ArgumentParser:
    """The options every engine benchmark has: model, chunk and memory sizes, and --quick."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--chunk-size", type=int, default=1000)
    parser.add_argument("--max-memory-tokens", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="small sizes: a minute or two")
    parser.add_argument(
        "--dtype", default="auto", choices=DTYPES, help="the engine's; auto: by the hardware"
    )
    return parser


def bench_method(args: argparse.Namespace, template: str = "memagent-reference") -> MethodConfig:
    return MethodConfig(chunk_size=args.chunk_size, max_memory_tokens=args.max_memory_tokens,
                        max_answer_tokens=32, template=template)  # fmt: skip


def engine_config(args: argparse.Namespace, kv_cache_gib: int = 2) -> VLLMEngineConfig:
    """Eager mode (about 40 s start-up on a CPU), a context that fits an update step."""
    needed = args.chunk_size + 2 * args.max_memory_tokens + 512
    return VLLMEngineConfig(model=models.resolve(args.model), max_model_len=max(4096, needed),
                            dtype=resolve_dtype(args.dtype), enforce_eager=True,
                            cpu_kvcache_space_gib=kv_cache_gib)  # fmt: skip


def load_tokenizer(config: VLLMEngineConfig) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(config.model)


def processed_tokens(results: Iterable[ChainResult]) -> int:
    return sum(result.prompt_tokens + result.completion_tokens for result in results)


@contextlib.asynccontextmanager
async def warm_engine(config: VLLMEngineConfig) -> AsyncIterator[VLLMEngine]:
    """An engine that has answered one short request, shut down on leaving."""
    engine = VLLMEngine(config)
    try:
        await engine.generate(GenerationRequest("warm-up", "Hello.", 4))
        yield engine
    finally:
        await engine.shutdown()


async def timed_run(runner: ChainRunner, chains: Sequence[MemoryChain]) -> dict[str, Any]:
    """Runs the chains at once: seconds, model calls, processed tokens, failed chains."""
    started = time.perf_counter()
    results = await runner.run(chains)
    return {
        "seconds": time.perf_counter() - started,
        "model_calls": sum(len(result.trajectory) for result in results),
        "processed_tokens": processed_tokens(results),
        "failed": sum(result.status != ChainStatus.DONE for result in results),
    }


def table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> list[str]:
    """Markdown table lines."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]


def tree_rss() -> int:
    """Summed RSS in bytes of this process and its descendants (vLLM's engine core and worker).
    Pages shared between them count once per process, so this is an upper bound."""
    me = psutil.Process()
    total = 0
    for process in [me, *me.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            total += process.memory_info().rss
    return total


class Sampler:
    """Calls `sample()` every `interval_s` in a thread while entered, once on entering (after
    `begin()`) and once on leaving."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample_until_stopped, daemon=True)

    def begin(self) -> None:
        """Runs once, before the first sample."""

    def sample(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        self.begin()
        self.started_at = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()

    def _sample_until_stopped(self) -> None:
        while True:
            self.sample()
            if self._stop.wait(self.interval_s):
                return


class PeakRss(Sampler):
    """`peak_bytes` is the highest `tree_rss` since the last `reset`."""

    def __init__(self, interval_s: float = 0.5) -> None:
        super().__init__(interval_s)
        self._lock = threading.Lock()
        self._peak = 0

    def reset(self) -> None:
        with self._lock:
            self._peak = tree_rss()

    @property
    def peak_bytes(self) -> int:
        self.sample()
        return self._peak

    def sample(self) -> None:
        rss = tree_rss()
        with self._lock:
            self._peak = max(self._peak, rss)


def process_role(process: psutil.Process) -> str:
    """What a process is, for counting where a run's CPU time goes: this benchmark, vLLM's
    engine processes, Ray's daemons, its actors and task workers, or anything else."""
    if process.pid == os.getpid():
        return "this process (driver)"
    name = process.name()
    title = " ".join(process.cmdline())  # a Ray worker's title is its first word
    if name.startswith("VLLM::") or "VLLM::" in title:
        return "vLLM engine core and worker"
    if name in ("raylet", "gcs_server"):
        return f"Ray {name}"
    if title.startswith(("ray::DashboardAgent", "ray::RuntimeEnvAgent")) or any(
        script in title for script in ("ray/dashboard", "log_monitor.py", "autoscaler/")
    ):
        return "Ray dashboard, agents and monitors"
    if title.startswith("ray::"):
        if "MapWorker" in title:
            return "Ray actor (memory operator)"
        return "Ray task workers and Ray Data's own actors"
    return "other processes"


class CpuByProcess(Sampler):
    """CPU seconds (user + system) every process on the machine spent while it was entered,
    summed by `process_role` and by `process_title`. Each interval's seconds go to what the
    process was at its end (a Ray worker's title changes with the task it runs). A process
    that starts and ends between two samples is missed."""

    def __init__(self, interval_s: float = 2.0) -> None:
        super().__init__(interval_s)
        self._seconds: dict[int, float] = {}
        self._by_role: dict[str, float] = {}
        self._by_title: dict[str, float] = {}

    def begin(self) -> None:
        self._seconds = {pid: seconds for pid, (_, _, seconds) in self._processes().items()}

    def sample(self) -> None:
        for pid, (role, title, seconds) in self._processes().items():
            spent = seconds - self._seconds.get(pid, 0.0)
            self._seconds[pid] = seconds
            self._by_role[role] = self._by_role.get(role, 0.0) + spent
            self._by_title[title] = self._by_title.get(title, 0.0) + spent

    def seconds_by_role(self) -> dict[str, float]:
        return _rounded_by_size(self._by_role)

    def seconds_by_title(self) -> dict[str, float]:
        return _rounded_by_size(self._by_title)

    @staticmethod
    def _processes() -> dict[int, tuple[str, str, float]]:
        seen = {}
        for process in psutil.process_iter():
            with contextlib.suppress(psutil.Error), process.oneshot():
                times = process.cpu_times()
                role, title = process_role(process), process_title(process)
                seen[process.pid] = (role, title, times.user + times.system)
        return seen


def process_title(process: psutil.Process) -> str:
    """A process's title: a Ray worker's names the task or actor it runs (`ray::IDLE`,
    `ray::MapWorker(MapBatches(MemoryStage))`), a Python process its script, others their name."""
    if process.pid == os.getpid():
        return "this process (driver)"
    command = process.cmdline()
    if command and command[0].startswith("ray::"):
        return command[0]
    scripts = [Path(word).name for word in command[1:3] if word.endswith(".py")]
    return f"{process.name()} {scripts[0]}" if scripts else process.name()


def _rounded_by_size(seconds: dict[str, float]) -> dict[str, float]:
    ordered = sorted(seconds.items(), key=lambda item: -item[1])
    return {key: round(value, 1) for key, value in ordered if round(value, 1) > 0}
