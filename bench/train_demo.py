"""The CPU demonstration of Multi-Conv DAPO (`make train`): does RL teach a small model to keep
a fact through its memory?

Phases, each saved to `state.json` as it ends, so `--resume` picks up where a run stopped:
1. probe: the untrained model's pass rate at the rollout temperature on training samples (the
   task is sized so that it lies between about 0.1 and 0.6: some groups then carry a signal);
2. before: held-out accuracy of the untrained model, greedy, on `--heldout` samples;
3. train: `memstream train` (pipeline.training.trainer) for `--steps` steps, checkpointed
   after each in `--run-dir`; a killed run resumes from its last checkpoint, and a larger
   `--steps` continues a finished one;
4. after: the same held-out samples on the trained checkpoint;
5. report: accuracy before and after with a paired exact test (McNemar's, on the samples one
   model got right and the other wrong) and a bootstrap interval of the difference, the reward
   curve as a PNG, and `results.md`.

Held-out samples share neither text nor keys with the training ones, nor text with `memstream
eval`'s haystacks (pipeline.training.tasks).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common

from connectors.engines import models
from connectors.engines.hardware import detect
from pipeline.training.config import TrainConfig
from pipeline.training.curve import plot_learning_curve
from pipeline.training.trainer import (
    CHECKPOINT_DIR,
    METRICS_FILE,
    SampleSource,
    run_training,
    score_heldout,
)

STATE_FILE = "state.json"
# The held-out sets a run's state may hold: (key suffix, what they are). The task's held-out
# split is the first; "_novels" is the split's earlier text, kept when a run predates the change.
HELDOUT_SETS = (
    ("", "the task's held-out split (prose of two NIST reports, which neither training nor "
     "`memstream eval` reads; keys of its own)"),
    ("_novels", "the split's earlier text (the novels' second half, whose prose `memstream "
     "eval`'s haystacks also hold; keys of its own)"),
)  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, default=common.RESULTS / "train-demo")
    parser.add_argument(
        "--run-dir",
        type=Path,
        default=Path.home() / ".cache" / "memstream" / "runs" / "train-demo",
        help="the training run (checkpoint, rollouts, metrics): outside the repository",
    )
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--preset", default="dapo", choices=("memagent", "dapo"))
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--samples-per-step", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--n-segments", type=int, default=2)
    parser.add_argument("--segment-tokens", type=int, default=120)
    parser.add_argument("--n-distractors", type=int, default=1)
    parser.add_argument("--max-memory-tokens", type=int, default=48)
    parser.add_argument("--learning-rate", type=float, default=2e-5)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--template", default="memagent-reference")
    parser.add_argument("--probe", type=int, default=32, help="training samples for the probe")
    parser.add_argument("--heldout", type=int, default=100, help="held-out samples")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args()

    output: Path = args.output
    output.mkdir(parents=True, exist_ok=True)
    state_path = output / STATE_FILE
    state: dict[str, Any] = (
        json.loads(state_path.read_text()) if args.resume and state_path.exists() else {}
    )
    config = TrainConfig(
        output=args.run_dir, model=args.model, preset=args.preset, steps=args.steps,
        samples_per_step=args.samples_per_step, group_size=args.group_size,
        n_segments=args.n_segments, segment_tokens=args.segment_tokens,
        n_distractors=args.n_distractors, chunk_size=args.segment_tokens + 32,
        max_memory_tokens=args.max_memory_tokens, max_answer_tokens=32,
        learning_rate=args.learning_rate, warmup_steps=2, raw_match=True,
        temperature=args.temperature, template=args.template,
        mini_batch_conversations=16, epochs_per_batch=1, resume=True,
    )  # fmt: skip
    state.setdefault("config", config.model_dump(mode="json"))
    hardware = detect()
    state.setdefault("cpu", f"{hardware.cpu_model}, {os.cpu_count()} cores, dtype float32")

    def save() -> None:
        state_path.write_text(json.dumps(state, indent=2))

    if not args.report_only:
        if "probe" not in state:
            state["probe"] = probe(config, args.probe)
            save()
            print(f"probe: pass rate {state['probe']['pass_rate']:.3f} at {config.temperature}")
        if "before" not in state:
            started = time.perf_counter()
            state["before"] = score_heldout(config, config.model, args.heldout)
            state["before_seconds"] = time.perf_counter() - started
            save()
            print(f"before: {mean(scores(state['before'], 'raw')):.3f} held-out (greedy, raw)")
        started = time.perf_counter()
        done_before = steps_done(args.run_dir)
        run_training(config)  # resumes; returns at once when the steps are done
        if steps_done(args.run_dir) > done_before:
            state["train_seconds"] = state.get("train_seconds", 0.0) + time.perf_counter() - started
            save()
        if state.get("after_steps") != steps_done(args.run_dir):
            state["after"] = score_heldout(config, args.run_dir / CHECKPOINT_DIR, args.heldout)
            state["after_steps"] = steps_done(args.run_dir)
            save()
            record_heldout(args.run_dir, state["after"])
            print(f"after: {mean(scores(state['after'], 'raw')):.3f} held-out (greedy, raw)")
    write_report(output, args.run_dir, state)
    return 0


def probe(config: TrainConfig, n_samples: int) -> dict[str, Any]:
    """The untrained model's pass rate at the rollout temperature, one chain per sample."""
    import asyncio

    from pipeline.training.rollout_engines import EngineRollouts

    wide = config.model_copy(update={"samples_per_step": n_samples, "group_size": 1})
    engines = EngineRollouts(wide)
    samples = SampleSource(wide, engines.tokenizer).draw(step=10_000, draw=0)
    started = time.perf_counter()

    async def run() -> list[float]:
        await engines.start(Path(models.resolve(config.model)))
        try:
            groups = await engines.roll_out(samples, step=10_000, draw=0)
        finally:
            await engines.stop()
        return [group[0].reward for group in groups]

    rewards = asyncio.run(run())
    return {
        "rewards": rewards,
        "pass_rate": mean(rewards),
        "seconds": time.perf_counter() - started,
    }


def steps_done(run_dir: Path) -> int:
    metrics = run_dir / METRICS_FILE
    return len(metrics.read_text().splitlines()) if metrics.exists() else 0


def scores(scored: list[dict[str, Any]], kind: str) -> list[float]:
    return [row[kind] for row in scored]


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def mcnemar_exact(before: list[float], after: list[float]) -> tuple[int, int, float]:
    """(improved, worsened, two-sided exact p) over the paired samples that changed."""
    improved = sum(1 for b, a in zip(before, after, strict=True) if a > b)
    worsened = sum(1 for b, a in zip(before, after, strict=True) if b > a)
    n = improved + worsened
    if n == 0:
        return 0, 0, 1.0
    tail = sum(math.comb(n, k) for k in range(min(improved, worsened) + 1)) / 2**n
    return improved, worsened, min(1.0, 2 * tail)


def bootstrap_interval(
    before: list[float], after: list[float], rounds: int = 10_000, seed: int = 0
) -> tuple[float, float]:
    """95% percentile interval of mean(after - before), resampling the paired samples."""
    rng = random.Random(seed)
    differences = [a - b for b, a in zip(before, after, strict=True)]
    n = len(differences)
    means = sorted(sum(rng.choice(differences) for _ in range(n)) / n for _ in range(rounds))
    return means[int(0.025 * rounds)], means[int(0.975 * rounds) - 1]


def record_heldout(run_dir: Path, scored: list[dict[str, Any]]) -> None:
    """The run's held-out figures, which `memstream models list` shows beside the run."""
    figures = {kind: mean(scores(scored, kind)) for kind in ("raw", "strict")}
    line = {"step": steps_done(run_dir), **figures, "n": len(scored)}
    with (run_dir / models.RUN_HELDOUT_LINES_FILE).open("a") as lines:
        lines.write(json.dumps(line) + "\n")


def write_report(output: Path, run_dir: Path, state: dict[str, Any]) -> None:
    metrics_path = run_dir / METRICS_FILE
    metrics = (
        [json.loads(line) for line in metrics_path.read_text().splitlines()]
        if metrics_path.exists()
        else []
    )
    if metrics:
        plot_learning_curve(metrics, [], output / "reward_curve.png")
    lines = ["# Multi-Conv DAPO on the CPU: keeping a fact through the memory", ""]
    lines.append(f"CPU: {state.get('cpu')}; config: `{json.dumps(state['config'])}`")
    lines.append("")
    if "probe" in state:
        lines.append(
            f"- probe (untrained, temperature {state['config']['temperature']}, "
            f"{len(state['probe']['rewards'])} training "
            f"samples): pass rate {state['probe']['pass_rate']:.3f}, "
            f"{state['probe']['seconds']:.0f} s"
        )
    for suffix, heldout in HELDOUT_SETS:
        if f"before{suffix}" not in state or f"after{suffix}" not in state:
            continue
        lines += [
            "",
            f"Held-out: {heldout}",
            "",
            "| held-out, greedy | samples | untrained | trained | difference (95% bootstrap) "
            "| improved / worsened | McNemar exact p |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for kind, label in (("raw", "gold anywhere in the reply"), ("strict", "answer format")):
            before = scores(state[f"before{suffix}"], kind)
            after = scores(state[f"after{suffix}"], kind)
            improved, worsened, p = mcnemar_exact(before, after)
            low, high = bootstrap_interval(before, after)
            lines.append(
                f"| {label} | {len(before)} | {mean(before):.3f} | {mean(after):.3f} | "
                f"{mean(after) - mean(before):+.3f} ({low:+.3f} to {high:+.3f}) | "
                f"{improved} / {worsened} | {p:.3g} |"
            )
    if metrics:
        busy = sum(row["rollout_seconds"] + row.get("learner_seconds", 0.0) for row in metrics)
        lines.append(
            f"\nTraining: {len(metrics)} steps, {busy / 60:.0f} min of rollouts and learner "
            "steps (engine restarts and checkpoint writes besides; `make train`, resumable)."
        )
    if metrics:
        lines += [
            "",
            "| step | reward mean | groups kept | loss | clip fraction | rollouts s | learner s |",
            "|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for row in metrics:
            lines.append(
                f"| {row['step']} | {row['reward_mean']:.3f} | {row['groups_kept']}/"
                f"{row['groups_drawn']} | {row.get('learner_loss', float('nan')):+.4f} | "
                f"{row.get('learner_clip_fraction', float('nan')):.3f} | "
                f"{row['rollout_seconds']:.0f} | {row.get('learner_seconds', float('nan')):.0f} |"
            )
    (output / "results.md").write_text("\n".join(lines) + "\n")
    print((output / "results.md").read_text())


if __name__ == "__main__":
    sys.exit(main())
