"""The learner's speed in float32 against bfloat16 autocast on one fixed batch, and the gap
between their log-probabilities (and the rollout engine's), in one process.

    .venv/bin/python bench/learner_dtype.py [--quick] [--model qwen2.5-coder-0.5b-instruct]
        [--task multi-fact+filing-figures] [--repeats 3] [--lora-rank 8]

1. The batch: `--samples` samples of the task rolled out by the training's own engine (vLLM in
   float32, temperature 1, the chain `make train-default` trains: the default model's template,
   its chunk, memory and answer budgets), `--group-size` chains each; the first
   `--conversations` of their conversations (updates and final answers, in chain order), as
   token ids with the engine's log-probabilities. The engine is shut down before the learners
   load (two cores).
2. The gap: two learners on the same starting weights, float32 and bfloat16 autocast (float32
   master weights), each computes the batch's response log-probabilities; the mean and largest
   |difference| per response token, the share of tokens whose probability ratio leaves PPO's
   clip range [0.8, 1.2], and each learner against the engine.
3. The speed: `Learner.step` on the batch (the old log-probabilities, then forward and backward
   and an AdamW step; LoRA of `--lora-rank` as `make train-default` trains, 0: every weight),
   alternately float32 and bfloat16, `--repeats` times each after one warm-up step each on the
   batch's two shortest conversations. Tokens per second count every real token through the
   model (`StepMetrics.tokens_per_s`); the table gives the median and the range.

Results: bench/results/learner_dtype.json and .md, with the CPU model and its bfloat16 flags;
learner_dtype-emulated-bf16.json and .md on a CPU without native bf16 (AVX2 only).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common
import torch

from connectors.engines import models
from connectors.engines.factory import open_engine
from connectors.engines.hardware import detect
from pipeline.cli.env import collect
from pipeline.training.config import LearnerDtype, TrainConfig
from pipeline.training.learner import Conversation, Learner
from pipeline.training.rollout import (
    PromptSplicer,
    load_tokenizer,
    roll_out_samples,
    rollout_engine_spec,
)
from pipeline.training.trainer import task_samples

DTYPES: tuple[LearnerDtype, ...] = ("float32", "bfloat16")
# PPO's clip range: a ratio outside it between the two precisions would be clipped noise.
CLIP = 0.2


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--task", default="multi-fact+filing-figures")
    parser.add_argument("--chunk-size", type=int, default=1000)
    parser.add_argument("--max-memory-tokens", type=int, default=256)
    parser.add_argument("--max-answer-tokens", type=int, default=64)
    parser.add_argument("--n-segments", type=int, default=3)
    parser.add_argument("--segment-tokens", type=int, default=1000)
    parser.add_argument("--samples", type=int, default=2, help="samples rolled out")
    parser.add_argument("--group-size", type=int, default=2, help="chains per sample")
    parser.add_argument("--conversations", type=int, default=4, help="of them, in the batch")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per dtype")
    parser.add_argument("--lora-rank", type=int, default=8, help="0: train every weight")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a small batch, one repeat")
    args = parser.parse_args()
    if args.quick:
        args.chunk_size, args.segment_tokens, args.max_memory_tokens = 300, 300, 64
        args.n_segments, args.samples, args.group_size = 1, 1, 2
        args.conversations, args.repeats = 2, 1
    started = time.perf_counter()
    config = TrainConfig(
        output=Path("unused"), model=args.model, task=args.task, chunk_size=args.chunk_size,
        max_memory_tokens=args.max_memory_tokens, max_answer_tokens=args.max_answer_tokens,
        n_segments=args.n_segments, segment_tokens=args.segment_tokens,
        samples_per_step=args.samples, group_size=args.group_size, preset="dapo",
        lora=args.lora_rank > 0, lora_rank=max(args.lora_rank, 1),
        lora_alpha=2.0 * max(args.lora_rank, 1), learning_rate=1e-6, warmup_steps=0,
        max_model_len=4096, kv_cache_gib=2, seed=args.seed,
    )  # fmt: skip
    base = models.resolve(config.model)
    batch = asyncio.run(roll_out(config, base))[: args.conversations]
    rolled = time.perf_counter() - started
    print(f"batch: {len(batch)} conversations, {sum(c.n_tokens for c in batch)} tokens "
          f"({sum(len(c.response_ids) for c in batch)} response), rollouts {rolled:.0f} s",
          flush=True)  # fmt: skip

    learners = {dtype: load_learner(config, base, dtype) for dtype in DTYPES}
    gap = logprob_gaps(learners, batch)
    print(f"gap: {gap}", flush=True)
    speed = timed_steps(learners, batch, args.repeats)
    del learners
    gc.collect()
    write(args, config, batch, gap, speed, rolled, time.perf_counter() - started)
    return 0


async def roll_out(config: TrainConfig, base: str) -> list[Conversation]:
    """The conversations of `config.samples_per_step` training samples' chains, as the trainer
    samples them at its first step."""
    tokenizer = load_tokenizer(base)
    samples = task_samples(config, tokenizer, config.samples_per_step, split="train")
    engine = open_engine(rollout_engine_spec(config, Path(base)))
    try:
        groups = await roll_out_samples(
            engine, PromptSplicer(tokenizer), config, samples, tokenizer, step=1, draw=0
        )
    finally:
        await engine.shutdown()
    return [
        Conversation(index, c.prompt_ids, c.response_ids, c.rollout_logprobs)
        for index, rollout in enumerate(r for group in groups for r in group)
        for c in rollout.conversations
        if c.response_ids
    ]


def load_learner(config: TrainConfig, base: str, dtype: LearnerDtype) -> Learner:
    settings = config.learner_config(base).model_copy(update={"dtype": dtype, "shuffle": False})
    return Learner(settings)


def logprob_gaps(learners: dict[str, Learner], batch: list[Conversation]) -> dict[str, Any]:
    """Response log-probabilities of both learners on the same weights (before any step),
    compared per token, and each against the engine's."""
    logprobs = {}
    for dtype, learner in learners.items():
        started = time.perf_counter()
        logprobs[dtype] = torch.cat(learner.response_logprobs(batch))
        seconds = time.perf_counter() - started
        print(f"{dtype}: log-probabilities in {seconds:.1f} s", flush=True)
    difference = logprobs["bfloat16"] - logprobs["float32"]
    ratio = difference.exp()
    result: dict[str, Any] = {
        "response_tokens": difference.numel(),
        "mean_abs_bf16_fp32": float(difference.abs().mean()),
        "max_abs_bf16_fp32": float(difference.abs().max()),
        "share_outside_clip": float(((ratio < 1 - CLIP) | (ratio > 1 + CLIP)).float().mean()),
        "mean_logprob_fp32": float(logprobs["float32"].mean()),
    }
    engine = [c.rollout_logprobs for c in batch]
    if all(values is not None for values in engine):
        reported = torch.tensor([value for values in engine for value in values or ()])
        for dtype, values in logprobs.items():
            result[f"mean_abs_engine_{dtype}"] = float((values - reported).abs().mean())
    return result


def timed_steps(
    learners: dict[str, Learner], batch: list[Conversation], repeats: int
) -> dict[str, list[dict[str, float]]]:
    """`repeats` steps per learner on the batch, alternating, after one warm-up step each on
    the two shortest conversations; each step's tokens per second and seconds."""
    advantages = [1.0 if c.sample_index % 2 == 0 else -1.0 for c in batch]
    shortest = sorted(range(len(batch)), key=lambda i: batch[i].n_tokens)[:2]
    for learner in learners.values():
        learner.step([batch[i] for i in shortest], [advantages[i] for i in shortest])
    runs: dict[str, list[dict[str, float]]] = {dtype: [] for dtype in learners}
    for repeat in range(repeats):
        for dtype, learner in learners.items():
            metrics = learner.step(batch, advantages)
            runs[dtype].append({"tokens_per_s": metrics.tokens_per_s, "seconds": metrics.seconds})
            print(f"repeat {repeat + 1}, {dtype}: {metrics.tokens_per_s:.0f} tokens/s, "
                  f"{metrics.seconds:.1f} s", flush=True)  # fmt: skip
    return runs


def write(
    args: argparse.Namespace,
    config: TrainConfig,
    batch: list[Conversation],
    gap: dict[str, Any],
    speed: dict[str, list[dict[str, float]]],
    rolled: float,
    seconds: float,
) -> None:
    machine = collect()
    flags = machine["cpu_flags"]
    cpu = machine["cpu"]
    native = ", ".join(flag for flag in ("avx512_bf16", "amx_bf16") if flags.get(flag)) or "none"
    medians = {
        dtype: statistics.median(run["tokens_per_s"] for run in runs)
        for dtype, runs in speed.items()
    }
    speedup = medians["bfloat16"] / medians["float32"]
    rows = [
        [
            dtype,
            f"{medians[dtype]:.0f}",
            "{:.0f}-{:.0f}".format(*spread(run["tokens_per_s"] for run in runs)),
            f"{statistics.median(r['seconds'] for r in runs):.1f}",
        ]
        for dtype, runs in speed.items()
    ]
    training = "LoRA rank " + str(args.lora_rank) if args.lora_rank else "every weight"
    engine_gaps = [
        f"float32 learner {gap['mean_abs_engine_float32']:.2e}",
        f"bfloat16 learner {gap['mean_abs_engine_bfloat16']:.2e}",
    ] if "mean_abs_engine_float32" in gap else ["not reported"]  # fmt: skip
    markdown = "\n".join([
        f"The learner on {args.model} ({training}, {config.chain().templates.name}), one fixed "
        f"batch of {len(batch)} conversations ({sum(c.n_tokens for c in batch)} tokens, "
        f"{gap['response_tokens']} of them response tokens) rolled out on `{args.task}` with "
        f"{args.chunk_size}-token chunks and a {args.max_memory_tokens}-token memory; "
        f"`Learner.step` alternately in each precision, {args.repeats} times each after a "
        f"warm-up. CPU: {cpu['model']} ({cpu['cores']} cores), bfloat16 instructions: {native}.",
        "",
        *common.table(["learner", "tokens/s (median)", "range", "seconds a step"], rows),
        "",
        f"bfloat16 autocast / float32: **{speedup:.2f}x**. Log-probability gap on the batch's "
        f"response tokens, bfloat16 against float32: mean {gap['mean_abs_bf16_fp32']:.2e}, "
        f"largest {gap['max_abs_bf16_fp32']:.2e} nats; probability ratio outside "
        f"[{1 - CLIP}, {1 + CLIP}]: {gap['share_outside_clip']:.2%} of tokens. Against the "
        f"rollout engine (vLLM, float32): {'; '.join(engine_gaps)}. Whole run {seconds:.0f} s "
        f"(rollouts {rolled:.0f} s).",
    ])  # fmt: skip
    payload = {
        "command": " ".join([".venv/bin/python bench/learner_dtype.py", *sys.argv[1:]]),
        "model": args.model, "task": args.task, "training": training,
        "template": config.chain().templates.name, "chunk_size": args.chunk_size,
        "max_memory_tokens": args.max_memory_tokens, "quick": args.quick,
        "cpu": cpu, "cpu_flags": flags, "torch": torch.__version__,
        "threads": torch.get_num_threads(), "conversations": len(batch),
        "tokens": sum(c.n_tokens for c in batch), "gap": gap, "runs": speed,
        "median_tokens_per_s": medians, "speedup_bf16": speedup, "seconds": seconds,
        "rollout_seconds": rolled,
    }  # fmt: skip
    # One result per kind of CPU: the choice `--learner-dtype auto` makes differs between them.
    name = "learner_dtype" if detect().native_bf16 else "learner_dtype-emulated-bf16"
    common.write_results(name, payload, markdown)


def spread(values: Any) -> tuple[float, float]:
    listed = list(values)
    return min(listed), max(listed)


if __name__ == "__main__":
    sys.exit(main())
