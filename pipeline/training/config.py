"""`memstream train`'s settings: one pydantic model, whose fields are the command's flags.

Kept apart from the trainer so that building the command line imports no torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal, cast, get_args

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from connectors.engines.factory import KvCacheGib, MaxModelLen, ModelName
from connectors.engines.hardware import detect
from operators.config import (
    ChunkSize,
    MaxAnswerTokens,
    MaxMemoryTokens,
    Seed,
    Temperature,
    TemplateName,
    TopP,
    default_template,
)
from operators.core.chain import ChainConfig
from operators.core.templates import get_template_set

if TYPE_CHECKING:
    from pipeline.training.algorithm import TrainingAlgorithmConfig
    from pipeline.training.learner import LearnerConfig

PresetName = Literal["memagent", "dapo"]
TaskName = Literal["keep-the-fact", "multi-fact", "table-figures", "filing-figures", "cuad"]
TASK_NAMES: tuple[TaskName, ...] = get_args(TaskName)
TASK_MIX_SEPARATOR = "+"
LearnerPlacement = Literal["in-process", "ray-train"]
# float32: the weights and every op in float32. bfloat16: the weights stay float32 (the master
# copy AdamW updates), the forward and backward run under torch.autocast to bfloat16 (matmuls in
# bfloat16, reductions and the log-softmax in float32).
LearnerDtype = Literal["float32", "bfloat16"]
# auto: bfloat16 where the CPU runs it natively (the engine's rule on a CPU), else float32.
LearnerDtypeChoice = Literal["auto", "float32", "bfloat16"]


def resolve_learner_dtype(choice: LearnerDtypeChoice) -> LearnerDtype:
    """The learner's precision for `choice`; `auto` asks the CPU the learner runs on (GPU
    clusters train with verl), as the engine's `auto` does."""
    if choice != "auto":
        return choice
    return "bfloat16" if detect().native_bf16 else "float32"


def mix_tasks(value: str) -> tuple[TaskName, ...]:
    """The tasks of `--task`: one name, or several joined by "+" (each at most once)."""
    names = value.split(TASK_MIX_SEPARATOR)
    unknown = [name for name in names if name not in TASK_NAMES]
    if unknown:
        raise ValueError(
            f"unknown task {', '.join(map(repr, unknown))}: one of {', '.join(TASK_NAMES)}, or "
            f"several joined by {TASK_MIX_SEPARATOR!r}"
        )
    if len(set(names)) != len(names):
        raise ValueError(f"--task {value}: a task appears twice in the mix")
    return cast("tuple[TaskName, ...]", tuple(names))


def _check_task_mix(value: str) -> str:
    mix_tasks(value)
    return value


TaskMix = Annotated[str, AfterValidator(_check_task_mix)]


class TrainConfig(BaseModel):
    """What `memstream train` takes; every field is a flag of the same name."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    output: Path = Field(description="Folder for the checkpoint (a loadable model) and metrics.")
    # The policy to train. The method's and the rollout engine's settings are theirs
    # (operators.config, connectors.engines.factory), with defaults for short training chains.
    model: ModelName = "smollm2-135m-instruct"
    answers: Path | None = Field(
        None,
        description="JSON Lines of {document, question, answers}: train on your own archive. "
        "Default: the task `--task` names.",
    )
    task: TaskMix = Field(
        "keep-the-fact",
        description="Training task without --answers, or several joined by '+' (e.g. "
        "multi-fact+filing-figures: sample i is task i mod k's sample i // k, so each step "
        "draws from every task in turn; held-out scores are reported per task): "
        "keep-the-fact (an access code among distractors in prose, pipeline.training.tasks); "
        "multi-fact (NIAH's multi-key and "
        "multi-value needles in turn among distractors, pipeline.training.needle_facts); "
        "table-figures (a figure of a synthetic table, its rows written as the PDF parser "
        "writes them under their column headers, in prose); filing-figures (a figure of a "
        "headed table row of the 2022 Q3 SEC filings, held out: 2023 Q1 and Q2; both "
        "pipeline.training.table_figures, scored as figures); or cuad (the labelled fields of "
        "the shared CUAD contracts, rewarded as the evaluation scores them: every party named; "
        "pipeline.training.contract_fields).",
    )
    preset: PresetName = Field("memagent", description="Algorithm preset: memagent or dapo.")
    steps: int = Field(20, ge=1, description="Rollout batches to train on (the run's total).")
    samples_per_step: int = Field(8, ge=1, description="Samples (groups) per rollout batch.")
    group_size: int = Field(8, ge=2, description="Sampled chains per sample, G.")
    n_segments: int = Field(3, ge=1, description="Synthetic task: segments per document.")
    segment_tokens: int = Field(200, ge=16, description="Synthetic task: tokens per segment.")
    n_distractors: int = Field(3, ge=0, description="Synthetic task: distractor facts per doc.")
    chunk_size: Annotated[ChunkSize, Field(ge=16)] = 200
    max_memory_tokens: MaxMemoryTokens = 64
    max_answer_tokens: MaxAnswerTokens = 32
    # Unset: the one the model is served with, so it learns the format it will answer in.
    template: TemplateName | None = None
    temperature: Annotated[Temperature, Field(gt=0.0)] = 1.0  # rollouts sample
    top_p: TopP = 1.0
    learning_rate: float = Field(1e-6, gt=0.0, description="AdamW learning rate.")
    warmup_steps: int = Field(20, ge=0, description="Optimiser steps of linear warm-up.")
    mini_batch_conversations: int = Field(32, ge=1, description="Conversations per optimiser step.")
    epochs_per_batch: int = Field(1, ge=1, description="Passes over each rollout batch.")
    micro_batch_tokens: int = Field(4096, ge=64, description="Padded tokens per forward pass.")
    learner_dtype: LearnerDtypeChoice = Field(
        "float32",
        description="The learner's compute precision: float32, or bfloat16 (float32 master "
        "weights and optimiser, forward and backward under torch.autocast to bfloat16; "
        "log-probabilities, ratios and KL in float32), or auto: bfloat16 on a CPU with "
        "native bf16 (avx512_bf16, AMX), float32 on other CPUs, where bf16 is emulated and "
        "slower. The rollout engine stays float32.",
    )
    lora: bool = Field(
        False,
        description="Train LoRA adapters on every linear layer instead of all weights (peft, in "
        "the train extra); the rollout engine loads the merged weights.",
    )
    lora_rank: int = Field(16, ge=1, description="LoRA rank r (with --lora).")
    lora_alpha: float = Field(32.0, gt=0.0, description="LoRA alpha; updates scale by alpha/r.")
    raw_match: bool = Field(
        False,
        description="Reward a gold answer found anywhere in the reply, not only after 'the "
        "answer is' (for models that seldom use the answer format).",
    )
    seed: Seed = 0  # seeds the samples, the rollouts and the learner too
    max_model_len: Annotated[MaxModelLen, Field(ge=256)] = 2048  # of the rollout engine
    kv_cache_gib: KvCacheGib = 1  # of the rollout engine
    resume: bool = Field(False, description="Continue the run in `output` from its checkpoint.")
    heldout_every: int = Field(
        0,
        ge=0,
        description="Score the held-out split every this many steps (and the starting weights "
        "first), greedy, one line a time in heldout.jsonl: the stop rule's measure; 0: never.",
    )
    heldout_samples: int = Field(
        40, ge=1, description="Held-out samples a --heldout-every scoring takes (a mix: in turn)."
    )
    learner: LearnerPlacement = Field(
        "in-process",
        description="Where the learner's optimiser steps run: in-process (this process, between "
        "rollouts) or ray-train (a Ray Train TorchTrainer of --learner-workers workers each "
        "rollout batch, gradients averaged by DDP; pipeline.training.ray_learner).",
    )
    learner_workers: int = Field(
        1, ge=1, description="Ray Train workers (data-parallel replicas of the policy)."
    )
    learner_gpus_per_worker: float = Field(
        0.0,
        ge=0.0,
        description="GPUs each Ray Train worker reserves; 0 trains on CPU (unverified on GPUs).",
    )
    learner_cpus_per_worker: float = Field(
        1.0, gt=0.0, description="CPUs each Ray Train worker reserves (its torch threads)."
    )
    learner_storage: str | None = Field(
        None,
        description="Ray Train's storage_path, where workers report checkpoints: a folder, or "
        "on a multi-node cluster a shared one (NFS, s3://...). Default: <output>/ray-train.",
    )
    rollout_actors: int = Field(
        0,
        ge=0,
        description="Sample the rollouts on a Ray actor pool of this many engines, each a "
        "share of every draw (the job's pattern); 0 samples them on one engine in this process.",
    )
    rollout_cpus_per_actor: float = Field(
        1.0, gt=0.0, description="CPUs each rollout actor reserves (with --rollout-actors)."
    )
    rollout_gpus_per_actor: float = Field(
        0.0,
        ge=0.0,
        description="GPUs each rollout actor reserves (with --rollout-actors); the actors load "
        "the checkpoint from --output, which every node must see. Unverified on GPUs.",
    )
    ray_address: str | None = Field(
        None,
        description="Ray cluster for --learner ray-train and --rollout-actors; unset: "
        "$RAY_ADDRESS, a running session, else a local one.",
    )

    @model_validator(mode="after")
    def _one_source_of_samples(self) -> TrainConfig:
        if self.answers is not None and self.task != "keep-the-fact":
            raise ValueError(f"--answers and --task {self.task} both name the samples: pass one")
        return self

    @model_validator(mode="after")
    def _workers_only_on_ray_train(self) -> TrainConfig:
        if self.learner == "in-process" and (
            self.learner_workers > 1 or self.learner_gpus_per_worker > 0
        ):
            raise ValueError(
                "--learner-workers and --learner-gpus-per-worker need --learner ray-train"
            )
        return self

    @model_validator(mode="after")
    def _actor_resources_need_actors(self) -> TrainConfig:
        if not self.rollout_actors and self.rollout_gpus_per_actor > 0:
            raise ValueError("--rollout-gpus-per-actor needs --rollout-actors")
        return self

    def algorithm(self) -> TrainingAlgorithmConfig:
        from pipeline.training.algorithm import TrainingAlgorithmConfig

        return TrainingAlgorithmConfig.preset(self.preset, group_size=self.group_size)

    def chain(self) -> ChainConfig:
        return ChainConfig(
            templates=get_template_set(self.template or default_template(self.model)),
            max_memory_tokens=self.max_memory_tokens,
            max_answer_tokens=self.max_answer_tokens,
        )

    def learner_config(self, base: str) -> LearnerConfig:
        from pipeline.training.learner import LearnerConfig

        return LearnerConfig(
            model=base,
            algorithm=self.algorithm(),
            learning_rate=self.learning_rate,
            warmup_steps=self.warmup_steps,
            mini_batch_conversations=self.mini_batch_conversations,
            epochs_per_batch=self.epochs_per_batch,
            micro_batch_tokens=self.micro_batch_tokens,
            temperature=self.temperature,
            seed=self.seed,
            lora=self.lora,
            lora_rank=self.lora_rank,
            lora_alpha=self.lora_alpha,
            dtype=resolve_learner_dtype(self.learner_dtype),
        )

    def tasks(self) -> tuple[TaskName, ...]:
        """The tasks `--task` names, in its order (one for a single task)."""
        return mix_tasks(self.task)
