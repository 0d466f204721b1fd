"""Both engine adapters against the real thing: vLLM in process, and vLLM's OpenAI server."""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import psutil
import pytest

from connectors.engines.hardware import default_gpu_memory_utilization, resolve_dtype
from connectors.engines.openai_http import OpenAIEngine, OpenAIEngineConfig
from connectors.engines.vllm_local import VLLMEngine, VLLMEngineConfig
from connectors.processes import ServerNotReady, ServerProcess, free_port, http_ok
from operators.config import MethodConfig
from operators.core.chain import ChainStatus
from operators.core.collection import Member
from operators.core.document import Document
from operators.engine import (
    Completion,
    EngineError,
    EngineUnhealthy,
    GenerationRequest,
    SamplingConfig,
)
from operators.runner import ChainRunner
from pipeline.ask import answer, prepare, prepare_collection
from pipeline.job import JobSpec
from tests.chat_server import JsonHandler
from tests.processes import engine_cores
from tests.test_collection import ALPHA, BETA

pytestmark = pytest.mark.engine

PROMPTS = [f"Name the number that comes after {n}. Answer with digits only." for n in range(8)]


def generate_all(engine, prompts, max_tokens=12):  # type: ignore[no-untyped-def]
    async def run():  # type: ignore[no-untyped-def]
        return await asyncio.gather(
            *(
                engine.generate(GenerationRequest(f"r{i}", p, max_tokens))
                for i, p in enumerate(prompts)
            )
        )

    return run()


def test_vllm_engine_answers_a_batch_with_usage(vllm_engine, event_loop_runner) -> None:  # type: ignore[no-untyped-def]
    started = time.perf_counter()
    completions = event_loop_runner.run(generate_all(vllm_engine, PROMPTS))
    elapsed = time.perf_counter() - started
    assert [c.request_id for c in completions] == [f"r{i}" for i in range(8)]
    for completion in completions:
        assert completion.text.strip()
        assert 10 < completion.prompt_tokens < 100
        assert 1 <= completion.completion_tokens <= 12
        assert completion.finish_reason in ("stop", "length")
        assert 0 < completion.latency_s <= elapsed


def test_vllm_engine_is_greedy_by_default(vllm_engine, event_loop_runner) -> None:  # type: ignore[no-untyped-def]
    """The same request, sent alone, gives the same text every time. Sent in a batch, it can
    differ in bfloat16 (see the next test)."""

    def one_at_a_time() -> list[str]:
        return [
            event_loop_runner.run(vllm_engine.generate(GenerationRequest(f"r{i}", p, 24))).text
            for i, p in enumerate(PROMPTS[:3])
        ]

    assert one_at_a_time() == one_at_a_time() == one_at_a_time()


def test_a_float32_engine_repeats_batches_whatever_their_timing(  # type: ignore[no-untyped-def]
    vllm_engine, event_loop_runner, test_model_path
) -> None:
    """Which requests share a step depends on when they arrive. In bfloat16 that can flip a
    near-tie token (on an Intel Xeon with AMX, SmolLM2 answered "after 0 is 11" in 7 of 15
    batches of these three prompts and "is 1" in 8); float32 repeats, so audits use it."""
    if vllm_engine.config.dtype == "float32":
        engine, owned = vllm_engine, False
    else:
        config = replace(vllm_engine.config, dtype="float32")
        engine, owned = event_loop_runner.run(_started(config)), True
    try:
        texts = {
            tuple(c.text for c in event_loop_runner.run(generate_all(engine, PROMPTS[:3], 24)))
            for _ in range(6)
        }
    finally:
        if owned:
            event_loop_runner.run(engine.shutdown())
    assert len(texts) == 1, texts


async def _started(config: VLLMEngineConfig) -> VLLMEngine:
    return VLLMEngine(config)  # inside the session's event loop, where its tasks will run


def test_sampled_requests_survive_prompts_prefilled_in_chunks(test_model_path: str) -> None:
    """Seeded sampling on CPU killed vLLM's engine when a prompt was prefilled in chunks (it
    rewinds a CUDA-only generator offset); a token budget of 64 a step forces the chunks."""
    engine = VLLMEngine(
        VLLMEngineConfig(
            model=test_model_path, max_model_len=1024, dtype=resolve_dtype("auto"),
            cpu_kvcache_space_gib=1, enforce_eager=True,
            engine_kwargs={"max_num_batched_tokens": 64, "max_num_seqs": 4},
        )
    )  # fmt: skip
    sampling = SamplingConfig(temperature=1.0, seed=7)
    prompts = [
        f"Story {i}: " + "the quick brown fox jumps over the lazy dog " * 12 for i in range(4)
    ]

    async def sampled() -> list[Completion]:
        try:
            completions = await asyncio.gather(
                *(
                    engine.generate(GenerationRequest(f"s{i}", prompt, 6, sampling))
                    for i, prompt in enumerate(prompts)
                )
            )
            await engine.check_health()
            return list(completions)
        finally:
            await engine.shutdown()

    completions = asyncio.run(sampled())
    assert all(completion.prompt_tokens > 64 for completion in completions)
    assert all(completion.completion_tokens >= 1 for completion in completions)


def test_vllm_engine_refuses_a_prompt_longer_than_its_window(
    vllm_engine, event_loop_runner
) -> None:  # type: ignore[no-untyped-def]
    request = GenerationRequest("long", "word " * 5000, 8)
    with pytest.raises(EngineError, match="max_model_len"):
        event_loop_runner.run(vllm_engine.generate(request))


def test_runner_drives_chains_of_different_lengths_together(  # type: ignore[no-untyped-def]
    vllm_engine, event_loop_runner, tokenizer
) -> None:
    method = MethodConfig(chunk_size=200, max_memory_tokens=24, max_answer_tokens=24)
    long_text = (
        "The harbour master logs every ship. " * 120
        + "The secret code is 4417. "
        + "Gulls cry. " * 60
    )
    short_text = "The lighthouse keeper is named Ada Brandt. " * 3
    documents = [
        prepare(
            Document(uri="long", name="long", text=long_text),
            ["What is the secret code?"],
            tokenizer,
            method,
        ),
        prepare(
            Document(uri="short", name="short", text=short_text),
            ["Who keeps the lighthouse?", "Is there a lighthouse?"],
            tokenizer,
            method,
        ),
    ]
    finished: list[str] = []  # chain ids, in the order their final step returned

    def on_step(chain, record) -> None:  # type: ignore[no-untyped-def]
        if record.kind == "final":
            finished.append(chain.chain_id)

    runner = ChainRunner(vllm_engine, method.sampling())
    results = event_loop_runner.run(answer(runner, documents, on_step))

    long_result = results["long"][0]
    short_results = results["short"]
    assert long_result.n_segments == len(documents[0].segments) > 3
    assert [r.n_segments for r in short_results] == [1, 1]
    # Each chain made one call per segment plus the final one, in order.
    for result in [long_result, *short_results]:
        assert result.status == ChainStatus.DONE, result.error
        assert [r.step for r in result.trajectory] == list(range(result.n_segments + 1))
        assert result.trajectory[-1].kind == "final"
        assert result.trajectory[-2].output == result.final_memory
        assert result.prompt_tokens == sum(r.prompt_tokens for r in result.trajectory)
        assert all(r.completion_tokens <= 24 for r in result.trajectory)
    # The short chains finished while the long one was still reading.
    assert sorted(finished[:2]) == ["short#q0", "short#q1"] and finished[2:] == ["long#q0"]
    segment_starts = [r.token_start for r in long_result.trajectory[:-1]]
    assert segment_starts == [s.token_start for s in documents[0].segments]


class RecordingEngine:
    """The real engine, with every prompt it was asked, by request id (`{chain_id}:{step}`)."""

    def __init__(self, engine) -> None:  # type: ignore[no-untyped-def]
        self.engine, self.model = engine, engine.model
        self.prompts: dict[str, str] = {}

    async def generate(self, request: GenerationRequest) -> Completion:
        self.prompts[request.request_id] = request.prompt
        return await self.engine.generate(request)


def test_a_collection_reads_each_member_in_order_under_its_header(  # type: ignore[no-untyped-def]
    vllm_engine, event_loop_runner, tokenizer
) -> None:
    """`ask --across` end to end on the real engine: one chain reads the members in order, one
    update per segment, each segment inside its member and shown under its member's header."""
    method = MethodConfig(chunk_size=64, max_memory_tokens=32, max_answer_tokens=24)
    gamma = "Gamma closes the set.\nThe green line says fact-green is kept."
    members = [
        Member("docs/alpha.txt", "alpha.txt", ALPHA),  # 2 segments
        Member("docs/beta.txt", "beta.txt", BETA),  # 2 segments
        Member("docs/gamma.txt", "gamma.txt", gamma),  # 1 segment
    ]
    prepared = prepare_collection("shelf", members, ["Which facts are kept?"], tokenizer, method)
    engine = RecordingEngine(vllm_engine)
    runner = ChainRunner(engine, method.sampling())
    [result] = event_loop_runner.run(answer(runner, [prepared]))["shelf"]

    assert result.status == ChainStatus.DONE, result.error
    assert isinstance(result.raw_response, str) and result.raw_response.strip()
    assert result.trajectory[-1].kind == "final"
    assert result.trajectory[-1].output == result.raw_response
    assert result.answer is None or isinstance(result.answer, str)
    updates = result.trajectory[:-1]
    assert [r.kind for r in updates] == ["update"] * len(prepared.segments)
    assert [r.step for r in result.trajectory] == list(range(len(prepared.segments) + 1))
    assert result.n_segments == len(prepared.segments) == 5
    # One engine call per step, no more.
    assert sorted(engine.prompts) == sorted(f"shelf#q0:{r.step}" for r in result.trajectory)

    # The update steps read the members in the order listed, each member whole and contiguous,
    # every segment a slice of its own member's text under that member's DocumentRef.
    read: dict[str, list[str]] = {}
    for record in updates:
        assert record.segment_index == record.step
        piece = prepared.segments[record.segment_index]
        assert (record.char_start, record.char_end) == (piece.char_start, piece.char_end)
        assert piece.doc_id in [m.doc_id for m in members]
        position = [m.doc_id for m in members].index(piece.doc_id) + 1
        member = members[position - 1]
        assert piece.text == member.text[piece.char_start : piece.char_end]
        assert piece.document is not None
        assert (piece.document.name, piece.document.position) == (member.name, position)
        assert piece.document.count == len(members)
        read.setdefault(member.name, []).append(piece.text)
        # The prompt the engine saw shows the member's header right before the segment.
        continued = ", continued" if read[member.name][:-1] else ""
        header = f"## Document {position} of {len(members)}{continued}: {member.name}"
        prompt = engine.prompts[f"shelf#q0:{record.step}"]
        assert f"{header}\n\n{piece.text}" in prompt
        assert prompt.count("## Document ") == 1
    assert list(read) == [m.name for m in members]  # in order, never interleaved
    assert ["".join(texts) for texts in read.values()] == [m.text for m in members]
    assert [len(texts) for texts in read.values()] == [2, 2, 1]
    assert [ref.name for ref in prepared.documents] == [m.name for m in members]

    grounding = prepared.grounding(result)
    labels = {f"doc {i}: {m.name}" for i, m in enumerate(members, 1)}
    for item in grounding.evidence:
        assert item.document in labels
        piece = prepared.segments[item.segment_index]
        assert piece.document is not None and item.document == piece.document.label
        member = members[piece.document.position - 1]
        assert member.text[item.char_start : item.char_end] == item.quote


@pytest.fixture(scope="module")
def openai_server(test_model_path: str, tmp_path_factory) -> Iterator[str]:  # type: ignore[no-untyped-def]
    """A real vLLM OpenAI-compatible server on 127.0.0.1, stopped by PID afterwards, in the
    dtype of the in-process `vllm_engine` it is compared with."""
    port = free_port()
    log = tmp_path_factory.mktemp("vllm-server") / "server.log"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "auto"}
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", test_model_path, "--served-model-name", "test-model",
        "--host", "127.0.0.1", "--port", str(port),
        "--max-model-len", "2048", "--enforce-eager", "--dtype", resolve_dtype("auto"),
        "--gpu-memory-utilization", str(default_gpu_memory_utilization()),
    ]  # fmt: skip
    server = ServerProcess(command, log, env=env)
    base_url = f"http://127.0.0.1:{port}/v1"
    try:
        try:
            server.wait_until(http_ok(f"{base_url}/models"), "vLLM server", timeout=400)
        except ServerNotReady as error:
            pytest.fail(str(error))
        yield base_url
    finally:
        server.stop(grace=30)


@pytest.mark.server
def test_openai_adapter_against_a_real_vllm_server(  # type: ignore[no-untyped-def]
    openai_server, vllm_engine, event_loop_runner
) -> None:
    async def run():  # type: ignore[no-untyped-def]
        engine = OpenAIEngine(OpenAIEngineConfig(base_url=openai_server, model="test-model"))
        try:
            await engine.check()
            return await asyncio.gather(
                *(engine.generate(GenerationRequest(f"h{i}", p, 12)) for i, p in enumerate(PROMPTS))
            )
        finally:
            await engine.shutdown()

    over_http = asyncio.run(run())
    in_process = event_loop_runner.run(generate_all(vllm_engine, PROMPTS))
    for remote, local in zip(over_http, in_process, strict=True):
        assert remote.text.strip()
        assert remote.prompt_tokens == local.prompt_tokens
        assert 1 <= remote.completion_tokens <= 12
    # Greedy decoding on the same weights: the server and the in-process engine agree.
    agreeing = sum(
        remote.text == local.text for remote, local in zip(over_http, in_process, strict=True)
    )
    assert agreeing >= len(PROMPTS) - 1, [
        (remote.text, local.text) for remote, local in zip(over_http, in_process, strict=True)
    ]


@pytest.mark.server
def test_openai_adapter_names_a_model_the_server_lacks(openai_server) -> None:  # type: ignore[no-untyped-def]
    engine = OpenAIEngine(OpenAIEngineConfig(base_url=openai_server, model="no-such-model"))
    with pytest.raises(EngineError, match="does not serve model 'no-such-model'"):
        asyncio.run(engine.check())


def test_openai_adapter_reports_an_unreachable_server() -> None:
    engine = OpenAIEngine(
        OpenAIEngineConfig(base_url=f"http://127.0.0.1:{free_port()}/v1", model="m", max_retries=1)
    )
    with pytest.raises(EngineError, match=r"cannot reach .* is the server running"):
        asyncio.run(engine.check())
    with pytest.raises(EngineUnhealthy, match=r"cannot reach .* is the server running"):
        asyncio.run(engine.check_health())


def test_openai_adapter_reports_a_connection_closed_as_it_opened_as_unreachable() -> None:
    """anyio raises AttributeError (getpeername of None) when a server going down closes the
    connection as it opens; seen in CI's down-server fault test. Other AttributeErrors stay."""
    engine = OpenAIEngine(OpenAIEngineConfig(base_url="http://127.0.0.1:9/v1", model="m"))

    async def fails_with(error: Exception) -> None:
        raise error

    dropped = AttributeError("'NoneType' object has no attribute 'getpeername'")
    with pytest.raises(EngineError, match=r"cannot reach .*closed the connection as it opened"):
        asyncio.run(engine._call(fails_with(dropped), 1.0, 0))
    with pytest.raises(AttributeError, match="no attribute 'choices'"):
        asyncio.run(engine._call(fails_with(AttributeError("no attribute 'choices'")), 1.0, 0))


class ModelListServer(JsonHandler):
    """Answers every GET as /v1/models does, with the one model "m", after `delay_s` seconds."""

    delay_s = 0.0
    requests = 0

    def do_GET(self) -> None:
        type(self).requests += 1
        time.sleep(self.delay_s)
        self.reply(
            200, b'{"object": "list", "data": [{"id": "m", "object": "model", "owned_by": "x"}]}'
        )


def test_openai_adapter_health_is_one_short_request_for_the_served_models() -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), ModelListServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    served = OpenAIEngine(OpenAIEngineConfig(base_url=url, model="m"))
    other = OpenAIEngine(OpenAIEngineConfig(base_url=url, model="other"))
    try:
        asyncio.run(served.check_health())
        with pytest.raises(EngineUnhealthy, match="does not serve model 'other'"):
            asyncio.run(other.check_health())
        ModelListServer.delay_s, ModelListServer.requests = 5.0, 0
        started = time.monotonic()
        with pytest.raises(EngineUnhealthy, match="did not answer within the timeout"):
            asyncio.run(served.check_health())
        waited = time.monotonic() - started
    finally:
        server.shutdown()
    # The engine's request timeout (600 s) and retries (5) are for generation, not for this.
    assert waited < 3 and ModelListServer.requests == 1


class FlakyChatServer(JsonHandler):
    """Answers 429, then 503, then a valid chat completion: a real HTTP peer that misbehaves."""

    attempts = 0

    def do_POST(self) -> None:
        type(self).attempts += 1
        self.rfile.read(int(self.headers["Content-Length"]))
        if self.attempts <= 2:
            status, body = (429 if self.attempts == 1 else 503), b'{"error": {"message": "busy"}}'
        else:
            status = 200
            body = (
                b'{"id": "x", "object": "chat.completion", "created": 0, "model": "m", "choices": '
                b'[{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", '
                b'"content": "ok"}}], "usage": {"prompt_tokens": 5, "completion_tokens": 1, '
                b'"total_tokens": 6}}'
            )
        self.reply(status, body)


def test_openai_adapter_retries_429_and_5xx_with_backoff() -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FlakyChatServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/v1"
        engine = OpenAIEngine(OpenAIEngineConfig(base_url=url, model="m", max_retries=3))
        completion = asyncio.run(engine.generate(GenerationRequest("a", "hi", 4, SamplingConfig())))
    finally:
        server.shutdown()
    assert completion.text == "ok" and completion.prompt_tokens == 5
    assert FlakyChatServer.attempts == 3


OWNER_SCRIPT = """
import asyncio, sys
from connectors.engines.vllm_local import VLLMEngine, VLLMEngineConfig

async def main():
    config = VLLMEngineConfig(model=sys.argv[1], max_model_len=1024, enforce_eager=True,
                              cpu_kvcache_space_gib=1)
    engine = VLLMEngine(config)
    print("ready", flush=True)
    await asyncio.sleep(900)

asyncio.run(main())
"""


@pytest.mark.engine
def test_engine_processes_end_when_their_owner_is_killed(
    test_model_path: str, tmp_path: Path
) -> None:
    """Ray kills actors with SIGKILL; vLLM's engine core must not outlive its actor."""
    log = tmp_path / "owner.log"
    with log.open("w") as output:
        owner = subprocess.Popen(
            [sys.executable, "-c", OWNER_SCRIPT, test_model_path],
            stdout=output, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    engine_processes: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 600
        while "ready" not in log.read_text(errors="replace").split():
            assert owner.poll() is None, log.read_text(errors="replace")[-3000:]
            assert time.monotonic() < deadline, "the engine did not start in time"
            time.sleep(1)
        engine_processes = psutil.Process(owner.pid).children(recursive=True)
        names = [process.name() for process in engine_processes]
        assert any("EngineCore" in name for name in names), names
        owner.kill()
        owner.wait()
        _, alive = psutil.wait_procs(engine_processes, timeout=60)
        assert not alive, f"engine processes outlived their owner: {alive}"
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
        for process in engine_processes:
            with contextlib.suppress(psutil.Error):
                process.kill()


def test_engine_kwargs_reach_vllm_untouched_and_win_over_the_modelled_settings() -> None:
    spec = JobSpec.from_dict(
        {
            "sources": ["docs/"],
            "output": "out/",
            "engine": {"engine_kwargs": {"max_num_seqs": 8, "enforce_eager": True}},
        }
    ).engine
    assert spec.engine_kwargs == {"max_num_seqs": 8, "enforce_eager": True}
    assert hash(spec) == hash(replace(spec, engine_kwargs={}))  # a cache key, as before
    config = VLLMEngineConfig(model="m", enforce_eager=False, engine_kwargs=spec.engine_kwargs)
    assert config.engine_args()["max_num_seqs"] == 8
    assert config.engine_args()["enforce_eager"] is True


def test_the_engine_step_budget_is_vllms_own_unless_told(vllm_engine) -> None:  # type: ignore[no-untyped-def]
    from vllm.config.scheduler import SchedulerConfig

    running = vllm_engine._llm.vllm_config.scheduler_config.max_num_batched_tokens
    assert running == SchedulerConfig.DEFAULT_MAX_NUM_BATCHED_TOKENS
    wide = VLLMEngineConfig(model="m", max_num_batched_tokens=4096)
    assert wide.engine_args()["max_num_batched_tokens"] == 4096
    told = VLLMEngineConfig(model="m", engine_kwargs={"max_num_batched_tokens": 1024})
    assert told.engine_args()["max_num_batched_tokens"] == 1024
    assert "speculative_config" not in wide.engine_args()
    speculative = VLLMEngineConfig(model="m", prompt_lookup_tokens=3).engine_args()
    assert speculative["speculative_config"]["method"] == "ngram"
    assert speculative["speculative_config"]["num_speculative_tokens"] == 3


def test_prompt_lookup_decodes_the_same_greedy_text_in_float32(test_model_path: str) -> None:
    """n-gram speculative decoding proposes tokens from the prompt and keeps only those the model
    would have chosen: in float32 a greedy copy of a passage comes out token for token the same."""
    passage = (
        "The storage node storage-node-17 reported that disk /var/lib/ledger is full at 03:14, "
        "and the ledger service stopped accepting writes until an operator cleared old segments."
    )
    prompts = [
        f"Copy this sentence exactly, then say which node failed.\n\n{passage}",
        f"<memory>\n{passage}\n</memory>\nRewrite the memory above word for word.",
    ]
    base = VLLMEngineConfig(
        model=test_model_path, max_model_len=1024, dtype="float32",
        cpu_kvcache_space_gib=1, enforce_eager=True,
    )  # fmt: skip

    async def texts(config: VLLMEngineConfig) -> list[str]:
        engine = VLLMEngine(config)
        try:
            completions = await asyncio.gather(
                *(engine.generate(GenerationRequest(f"p{i}", p, 48)) for i, p in enumerate(prompts))
            )
            speculative = engine._llm.vllm_config.speculative_config
            assert (speculative is not None) == bool(config.prompt_lookup_tokens)
            return [completion.text for completion in completions]
        finally:
            await engine.shutdown()

    plain = asyncio.run(texts(base))
    looked_up = asyncio.run(texts(replace(base, prompt_lookup_tokens=4)))
    assert looked_up == plain
    assert any("storage-node-17" in text for text in plain)  # the model did copy from its prompt


def test_vllm_engine_health_reports_a_killed_engine_core(test_model_path: str) -> None:
    """The EngineCore process dies (SIGKILL here, as by the kernel's OOM killer): the engine's
    health check says so within seconds, and its worker processes end with it."""
    config = VLLMEngineConfig(
        model=test_model_path,
        max_model_len=1024,
        dtype=resolve_dtype("auto"),
        enforce_eager=True,
        cpu_kvcache_space_gib=1,
    )
    this_process = psutil.Process()

    async def kill_the_engine_core() -> tuple[float, str, list[psutil.Process]]:
        others = set(engine_cores(this_process))  # the session's shared engine, if it runs
        engine = VLLMEngine(config)
        try:
            await engine.check_health()
            (core,) = [process for process in engine_cores(this_process) if process not in others]
            workers = core.children(recursive=True)
            os.kill(core.pid, signal.SIGKILL)
            waited, reason = await seconds_until_unhealthy(engine, timeout_s=30)
        finally:
            await engine.shutdown()
        return waited, reason, workers

    waited, reason, workers = asyncio.run(kill_the_engine_core())
    print(f"\nunhealthy {waited:.2f} s after the kill: {reason}")
    assert "EngineCore is dead" in reason and "\n" not in reason
    assert waited < 10
    _, alive = psutil.wait_procs(workers, timeout=30)
    for process in alive:
        process.kill()
    assert not alive, f"worker processes outlived their EngineCore: {alive}"


async def seconds_until_unhealthy(engine: VLLMEngine, timeout_s: float) -> tuple[float, str]:
    """Seconds until `check_health` raised, and the reason it gave."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        try:
            await engine.check_health()
        except EngineUnhealthy as unhealthy:
            return time.monotonic() - started, str(unhealthy)
        await asyncio.sleep(0.05)
    raise AssertionError(f"the engine still looked healthy {timeout_s:.0f} s after the kill")
