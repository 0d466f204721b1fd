"""Engine efficiency: the same chains on the same engine, driven two ways, against a ceiling.

- memstream's ChainRunner: each chain submits its next step as soon as its last one returns.
- step-synchronous: step k of every chain still reading goes to `LLM.generate` as one batch,
  and step k+1 starts when the whole batch is done (the simple approach).
- ceiling: every request the runner sent, replayed at once on the runner's engine, as if no
  step waited for the one before. Greedy decoding makes the replay the same work; what the
  engine does with it is the most tokens/s the chains could get.

Reports wall time, tokens/s and their ratios, measured one after the other in one run.
"""

from __future__ import annotations

import asyncio
import gc
import time
from dataclasses import replace
from typing import Any

from common import (
    bench_method,
    bench_parser,
    documents_of_lengths,
    engine_config,
    load_tokenizer,
    write_results,
)

from connectors.engines.vllm_local import VLLMEngine, VLLMEngineConfig, chat_prompt_ids
from operators.config import MethodConfig
from operators.core.document import Document
from operators.engine import Completion, GenerationRequest
from operators.runner import ChainRunner
from pipeline.ask import PreparedDocument, prepare

FULL_LENGTHS = "4000,8000,16000,32000,64000,200000"  # mixed lengths, as a real archive has


class BusyMeter:
    """Wraps an engine, integrates how many requests are in flight over time and keeps every
    request it passed on."""

    def __init__(self, engine: VLLMEngine) -> None:
        self.engine = engine
        self.requests: list[GenerationRequest] = []
        self.in_flight = 0
        self.busy_s = 0.0
        self.request_seconds = 0.0
        self._last = time.perf_counter()

    def _tick(self) -> None:
        now = time.perf_counter()
        if self.in_flight:
            self.busy_s += now - self._last
            self.request_seconds += self.in_flight * (now - self._last)
        self._last = now

    async def generate(self, request: GenerationRequest) -> Completion:
        self._tick()
        self.requests.append(request)
        self.in_flight += 1
        try:
            return await self.engine.generate(request)
        finally:
            self._tick()
            self.in_flight -= 1

    async def check_health(self) -> None:
        await self.engine.check_health()

    async def shutdown(self) -> None:
        await self.engine.shutdown()


def build(
    tokenizer: Any, lengths: list[int], questions: int, method: MethodConfig
) -> list[PreparedDocument]:
    asked = [f"What is said about topic {q}?" for q in range(questions)]
    return [
        prepare(Document(uri=doc_id, name=doc_id, text=text), asked, tokenizer, method)
        for doc_id, text in documents_of_lengths(tokenizer, lengths)
    ]


async def run_memstream(config: VLLMEngineConfig, documents, method):  # type: ignore[no-untyped-def]
    engine = BusyMeter(VLLMEngine(config))
    runner = ChainRunner(engine, method.sampling())
    started = time.perf_counter()
    chains = [chain for document in documents for chain in document.chains]
    results = await runner.run(chains)
    elapsed = time.perf_counter() - started
    total = sum(r.prompt_tokens + r.completion_tokens for r in results)
    runner_figures = {
        "seconds": elapsed,
        "tokens": total,
        "tokens_per_s": total / elapsed,
        "busy_fraction": engine.busy_s / elapsed,
        "mean_requests_in_flight": engine.request_seconds / elapsed,
    }
    try:
        ceiling = await replay_at_once(engine.engine, engine.requests)
    finally:
        await engine.shutdown()
    return runner_figures, ceiling


async def replay_at_once(engine: VLLMEngine, requests: list[GenerationRequest]) -> dict[str, float]:
    await engine.reset_prefix_cache()
    replayed = [replace(request, request_id=f"replay-{request.request_id}") for request in requests]
    started = time.perf_counter()
    completions = await asyncio.gather(*(engine.generate(request) for request in replayed))
    elapsed = time.perf_counter() - started
    total = sum(c.prompt_tokens + c.completion_tokens for c in completions)
    return {"seconds": elapsed, "tokens": total, "tokens_per_s": total / elapsed}


def run_step_synchronous(config: VLLMEngineConfig, documents, method):  # type: ignore[no-untyped-def]
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(**config.engine_args())
    tokenizer = llm.get_tokenizer()
    sampling = method.sampling()
    chains = [chain for document in documents for chain in document.chains]
    started = time.perf_counter()
    total = 0
    while active := [chain for chain in chains if not chain.done]:
        requests = [chain.next_request() for chain in active]
        prompts = [
            TokensPrompt(prompt_token_ids=chat_prompt_ids(tokenizer, r.prompt)) for r in requests
        ]
        params = [
            SamplingParams(max_tokens=r.max_tokens, temperature=sampling.temperature,
                           top_p=sampling.top_p, seed=sampling.seed)
            for r in requests
        ]  # fmt: skip
        outputs = llm.generate(prompts, params, use_tqdm=False)
        for chain, prompt, output in zip(active, prompts, outputs, strict=True):
            completion = output.outputs[0]
            chain.submit(completion.text)
            total += len(prompt["prompt_token_ids"]) + len(completion.token_ids)
    elapsed = time.perf_counter() - started
    del llm
    gc.collect()
    return {"seconds": elapsed, "tokens": total, "tokens_per_s": total / elapsed}


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--lengths", help=f"document tokens; default {FULL_LENGTHS}")
    parser.add_argument("--questions", type=int, default=1, help="per document; default 1")
    args = parser.parse_args()
    args.lengths = args.lengths or ("1000,2000" if args.quick else FULL_LENGTHS)
    lengths = [int(n) for n in args.lengths.split(",")]
    method = bench_method(args)
    config = engine_config(args)
    tokenizer = load_tokenizer(config)
    memstream, ceiling = asyncio.run(
        run_memstream(config, build(tokenizer, lengths, args.questions, method), method)
    )
    baseline = run_step_synchronous(
        config, build(tokenizer, lengths, args.questions, method), method
    )
    ratio = memstream["tokens_per_s"] / baseline["tokens_per_s"]
    of_ceiling = memstream["tokens_per_s"] / ceiling["tokens_per_s"]
    markdown = "\n".join([
        f"Engine efficiency, {args.model}, documents of {args.lengths} tokens, "
        f"{args.questions} question(s) each, chunk {args.chunk_size}, "
        f"memory {args.max_memory_tokens}, {config.dtype}, eager",
        "",
        "| driver | seconds | tokens | tokens/s | engine busy | mean requests in flight |",
        "|---|---|---|---|---|---|",
        f"| memstream runner | {memstream['seconds']:.1f} | {memstream['tokens']} | "
        f"{memstream['tokens_per_s']:.0f} | {memstream['busy_fraction']:.0%} | "
        f"{memstream['mean_requests_in_flight']:.1f} |",
        f"| step-synchronous LLM.generate | {baseline['seconds']:.1f} | {baseline['tokens']} | "
        f"{baseline['tokens_per_s']:.0f} | - | - |",
        f"| ceiling: the runner's requests replayed at once | {ceiling['seconds']:.1f} | "
        f"{ceiling['tokens']} | {ceiling['tokens_per_s']:.0f} | - | - |",
        "",
        f"runner / step-synchronous tokens/s: **{ratio:.2f}x**; "
        f"runner / ceiling: **{of_ceiling:.2f}x**",
    ])  # fmt: skip
    write_results(
        "engine_efficiency",
        {"args": vars(args), "memstream": memstream, "step_synchronous": baseline,
         "ceiling": ceiling, "ratio": ratio, "runner_of_ceiling": of_ceiling},
        markdown,
    )  # fmt: skip


if __name__ == "__main__":
    main()
