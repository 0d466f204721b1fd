"""The learner: a causal LM in fp32 trained on a rollout batch's conversations by Multi-Conv DAPO.

The weights are float32; with `dtype="bfloat16"` the forward and backward passes run under
bfloat16 autocast (mixed precision: float32 master weights and AdamW state, bfloat16 matmuls),
the logits cast back to float32 before the log-softmax.

A rollout batch is a flat list of `Conversation`s (every update and final conversation of every
chain), each with the advantage of the chain it belongs to. `Learner.step` recomputes the old
log-probabilities with the current weights (so the ratio starts at exactly 1, whatever precision
the rollout engine ran in), then takes `epochs_per_batch` passes over the batch in mini-batches of
`mini_batch_conversations`, one optimiser step per mini-batch, so the later steps see a ratio away
from 1 and the clip acts. Forward passes run in micro-batches of right-padded sequences of at most
`micro_batch_tokens`, each scaled by its mini-batch's response-token count so that their gradients
add up to the mini-batch's token mean. Log-probabilities are computed only at response positions.

The model stays in eval mode (no dropout), so the training forward matches the no-grad one that
gave the old log-probabilities.

Data parallelism (`distribute`, as the Ray Train worker calls it, pipeline.training.ray_learner):
every worker draws the same plan, takes every `world_size`-th conversation of each mini-batch, and
scales its loss by the whole mini-batch's token count, so that the sum over workers of their
gradients is the one-process gradient; DDP averages, so the backward is multiplied by
`world_size`. Each worker synchronises once per optimiser step, on its last micro-batch, and a
worker whose share of a mini-batch is empty runs one conversation at weight 0 so that its
collective calls match the others'. The metrics are summed over the workers.

`save_checkpoint` writes a folder that transformers and vLLM load as a model, plus the optimiser,
scheduler, step counters and RNG state; `export_weights` writes the weights alone, for the
rollout engine to reload.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor
from transformers import AutoModelForCausalLM

from pipeline.training.algorithm import (
    TrainingAlgorithmConfig,
    clipped_token_loss,
    low_var_kl,
    token_mean,
)
from pipeline.training.config import LearnerDtype

# What makes a weights folder loadable as a model beside config.json and the safetensors.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "generation_config.json",
    "memstream-model.json",
)
STATE_FILE = "learner-state.pt"
SUMMARY_FILE = "learner.json"
ADAPTER_DIR = "adapter"
CHECKPOINT_FORMAT = 1


@dataclass(frozen=True)
class Conversation:
    """One model call of a rollout: its prompt and reply as token ids. A chain's K update
    conversations and its final one share `sample_index`. `rollout_logprobs` are the reply's
    log-probabilities as the engine reported them, if it did; the learner only compares them
    with its own."""

    sample_index: int
    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    rollout_logprobs: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("a conversation needs at least one prompt token")
        if self.rollout_logprobs is not None and len(self.rollout_logprobs) != len(
            self.response_ids
        ):
            raise ValueError(
                f"rollout_logprobs has {len(self.rollout_logprobs)} values for "
                f"{len(self.response_ids)} response tokens"
            )

    @property
    def n_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


class LearnerConfig(BaseModel):
    """The learner's knobs; the algorithm's are in `algorithm`. Defaults follow the MemAgent
    reference scripts (run_memory_7B.sh) where they set one."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(
        description="Local Hugging Face folder of the initial policy, also the KL reference."
    )
    algorithm: TrainingAlgorithmConfig = Field(
        default_factory=TrainingAlgorithmConfig,
        description="Clips, KL and entropy weights (`TrainingAlgorithmConfig.preset(...)`).",
    )
    learning_rate: float = Field(
        1e-6, gt=0.0, description="AdamW learning rate, constant after the warm-up."
    )
    warmup_steps: int = Field(
        20,
        ge=0,
        description="Optimiser steps of linear warm-up: step s (from 0) uses "
        "lr * min(1, (s + 1) / warmup_steps).",
    )
    weight_decay: float = Field(0.01, ge=0.0, description="AdamW's decoupled weight decay.")
    grad_clip: float = Field(
        1.0, gt=0.0, description="Gradients are clipped to this global L2 norm before each step."
    )
    mini_batch_conversations: int = Field(
        64,
        ge=1,
        description="Conversations per optimiser step: a rollout batch of N conversations gives "
        "ceil(N / this) steps per epoch.",
    )
    epochs_per_batch: int = Field(
        1,
        ge=1,
        description="Passes over each rollout batch. Together with the mini-batches this sets "
        "the optimiser steps per rollout batch (the reference: 128 / 8 = 16), after the first of "
        "which the ratio leaves 1 and the clip acts.",
    )
    shuffle: bool = Field(
        True,
        description="Shuffle the batch's conversations before cutting each epoch's "
        "mini-batches, so a mini-batch mixes chains.",
    )
    micro_batch_tokens: int = Field(
        8192,
        ge=1,
        description="Most padded tokens (sequences x longest length) in one forward pass; a "
        "longer conversation goes through alone.",
    )
    temperature: float = Field(
        1.0,
        gt=0.0,
        description="The rollouts' sampling temperature: logits are divided by it, so the "
        "policy trained is the one that sampled (as verl does).",
    )
    seed: int = Field(0, description="Seeds torch and the shuffling of mini-batches.")
    device: str = Field("cpu", description="torch device of the model and the loss.")
    lora: bool = Field(
        False,
        description="Train LoRA adapters on every linear layer instead of all weights (needs "
        "peft: the `train` extra). Checkpoints and exports hold the merged weights.",
    )
    dtype: LearnerDtype = Field(
        "float32",
        description="Compute precision. float32: weights and every op. bfloat16: float32 master "
        "weights (AdamW updates them), forward and backward under torch.autocast to bfloat16, "
        "the logits cast back to float32 before the log-softmax.",
    )
    lora_rank: int = Field(16, ge=1, description="LoRA rank r.")
    lora_alpha: float = Field(32.0, gt=0.0, description="LoRA alpha; updates scale by alpha/r.")


@dataclass(frozen=True)
class MiniBatchMetrics:
    """One optimiser step. Shares and means are over the mini-batch's response tokens."""

    loss: float
    clip_fraction: float
    approx_kl: float  # mean of old - new log-probability before this step
    dual_clip_fraction: float
    kl: float | None  # low-var KL to the reference, when there is one
    entropy: float | None  # when entropy_coef > 0
    grad_norm: float  # before clipping
    learning_rate: float
    n_tokens: int
    n_conversations: int


@dataclass(frozen=True)
class StepMetrics:
    """One rollout batch. `loss` and `grad_norm` are means over the optimiser steps; the shares
    and KLs are token-weighted over them. `tokens_per_s` counts every real (unpadded) token that
    went through the model, the old-log-probability and reference passes included."""

    loss: float
    clip_fraction: float
    approx_kl: float
    dual_clip_fraction: float
    kl: float | None
    entropy: float | None
    grad_norm: float
    learning_rate: float
    n_tokens: int  # response tokens of the batch
    n_conversations: int
    optimizer_steps: int
    rollout_logprob_abs_diff: float | None  # learner's old log-probabilities vs the engine's
    tokens_per_s: float
    seconds: float
    mini_batches: tuple[MiniBatchMetrics, ...]
    dtype: str = "float32"  # the learner's compute precision (LearnerConfig.dtype)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> StepMetrics:
        """The inverse of `to_dict`: metrics that crossed a process boundary as a dict."""
        mini_batches = tuple(MiniBatchMetrics(**step) for step in values["mini_batches"])
        return cls(**{**values, "mini_batches": mini_batches})


@dataclass(frozen=True)
class Shard:
    """One worker's part of a mini-batch: its micro-batches of conversation indices, and the
    whole mini-batch's response tokens and conversations (the loss's normaliser). `weight` is 0
    for a worker with no conversation of its own, which runs one at weight 0 to keep step."""

    micro_batches: list[list[int]]
    n_tokens: int
    n_conversations: int
    weight: float = 1.0


class ResponseLogits(torch.nn.Module):
    """The causal LM's logits at the given (row, position) pairs, divided by the temperature:
    the LM head runs only on the hidden states that predict a response token. The module data
    parallelism wraps, so that the training forward is the one DDP sees."""

    def __init__(self, model: torch.nn.Module, temperature: float) -> None:
        super().__init__()
        self.model = model
        self.temperature = temperature

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor, rows: Tensor, positions: Tensor
    ) -> Tensor:
        hidden = self.model.get_decoder()(
            input_ids=input_ids, attention_mask=attention_mask, use_cache=False
        ).last_hidden_state
        # The LM head in float32 also under bfloat16 autocast: logits of about 20 in bfloat16
        # are 0.06-0.125 apart, an error every log-probability would carry.
        with torch.autocast(hidden.device.type, enabled=False):
            logits = self.model.get_output_embeddings()(hidden[rows, positions].float()).float()
        softcap = getattr(self.model.config, "final_logit_softcapping", None)
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        if self.temperature != 1.0:
            logits = logits / self.temperature
        return logits


class Learner:
    """Holds the policy, its optimiser and scheduler, and (when kl_coef > 0) a frozen reference.

    `initial_weights` loads the policy from another folder than `config.model` (a checkpoint);
    the reference always comes from `config.model`. A learner is one process until
    `distribute` makes it one worker of a data-parallel group.
    """

    def __init__(self, config: LearnerConfig, *, initial_weights: str | Path | None = None) -> None:
        base = Path(config.model)
        if not (base / "config.json").is_file():
            raise ValueError(f"{base} is not a Hugging Face model folder (no config.json)")
        self.config = config
        self.base_path = base
        self.device = torch.device(config.device)
        torch.manual_seed(config.seed)
        self.generator = torch.Generator().manual_seed(config.seed)
        self.model = self._load_policy(Path(initial_weights) if initial_weights else None)
        self.policy = ResponseLogits(self.model, config.temperature)
        self.trained: torch.nn.Module = self.policy  # the policy, or its DDP wrapper
        self.rank, self.world_size = 0, 1
        self.reference: ResponseLogits | None = None
        if config.algorithm.kl_coef > 0 and not config.lora:
            self.reference = ResponseLogits(_load_model(base, self.device), config.temperature)
            self.reference.requires_grad_(False)
        trainable = [parameter for parameter in self.model.parameters() if parameter.requires_grad]
        self.optimizer = torch.optim.AdamW(
            trainable, lr=config.learning_rate, weight_decay=config.weight_decay, fused=True
        )
        warmup = config.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0
        )
        self.global_step = 0  # optimiser steps taken
        self.updates = 0  # rollout batches trained on

    @classmethod
    def resume(cls, directory: str | Path, config: LearnerConfig) -> Learner:
        """The learner as `save_checkpoint(directory)` left it. If a save was killed between
        its two renames, the previous checkpoint is read from `<directory>.previous`."""
        found = existing_checkpoint(directory)
        if found is None:
            raise FileNotFoundError(f"{directory} holds no learner checkpoint ({STATE_FILE})")
        directory = found
        learner = cls(config, initial_weights=directory)
        state = torch.load(directory / STATE_FILE, weights_only=True)
        if state["format"] != CHECKPOINT_FORMAT:
            raise ValueError(f"checkpoint format {state['format']}, expected {CHECKPOINT_FORMAT}")
        learner.optimizer.load_state_dict(state["optimizer"])
        learner.scheduler.load_state_dict(state["scheduler"])
        learner.global_step = state["global_step"]
        learner.updates = state["updates"]
        torch.set_rng_state(state["torch_rng"])
        learner.generator.set_state(state["generator"])
        return learner

    def distribute(
        self,
        *,
        rank: int,
        world_size: int,
        wrap: Callable[[torch.nn.Module], torch.nn.Module],
    ) -> None:
        """Makes this learner worker `rank` of `world_size`, its training forward going through
        `wrap(policy)` (Ray Train's `prepare_model`, which wraps it in DDP when there is more
        than one worker). Every worker must start from the same weights, state and seed."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, {world_size})")
        self.rank, self.world_size = rank, world_size
        self.trained = wrap(self.policy)

    def learn(
        self, signal: tuple[Sequence[Conversation], Tensor | Sequence[float]] | None
    ) -> StepMetrics | None:
        """A `step` on (conversations, advantages), or `skip_batch` when the batch carried no
        signal (None): what the trainer does with each rollout batch, in process or on Ray
        Train."""
        if signal is None:
            self.skip_batch()
            return None
        return self.step(*signal)

    def _load_policy(self, weights: Path | None) -> torch.nn.Module:
        if not self.config.lora:
            return _load_model(weights or self.base_path, self.device)
        peft = _import_peft()
        base = _load_model(self.base_path, self.device)
        if weights is not None:
            return peft.PeftModel.from_pretrained(base, weights / ADAPTER_DIR, is_trainable=True)
        lora = peft.LoraConfig(
            r=self.config.lora_rank,
            lora_alpha=self.config.lora_alpha,
            lora_dropout=0.0,
            target_modules="all-linear",
            task_type="CAUSAL_LM",
        )
        return peft.get_peft_model(base, lora)

    def response_logprobs(
        self, conversations: Sequence[Conversation], *, micro_batch_tokens: int | None = None
    ) -> list[Tensor]:
        """Each response token's log-probability given its prompt and the response tokens
        before it, under the current weights: one fp32 tensor per conversation, no graph."""
        budget = micro_batch_tokens or self.config.micro_batch_tokens
        lengths = [conversation.n_tokens for conversation in conversations]
        micro_batches = _pack(list(range(len(conversations))), lengths, budget)
        return self._logprobs_by_micro_batch(self.policy, conversations, micro_batches)

    def step(
        self,
        conversations: Sequence[Conversation],
        advantages_per_conversation: Tensor | Sequence[float],
        ref_logprobs: Sequence[Tensor] | None = None,
    ) -> StepMetrics:
        """Trains on one rollout batch: `epochs_per_batch` x ceil(N / mini_batch_conversations)
        optimiser steps. `ref_logprobs` (one tensor per conversation) are the reference policy's;
        when kl_coef > 0 and they are not given, the learner computes them once, before the
        first step; given with kl_coef 0, they only feed the `kl` metric."""
        started = time.perf_counter()
        n = len(conversations)
        if n == 0:
            raise ValueError("step needs at least one conversation")
        advantages = torch.as_tensor(advantages_per_conversation, dtype=torch.float32)
        if advantages.shape != (n,):
            raise ValueError(f"need one advantage per conversation ({n}), got {advantages.shape}")
        if ref_logprobs is not None and [lp.numel() for lp in ref_logprobs] != [
            len(conversation.response_ids) for conversation in conversations
        ]:
            raise ValueError("ref_logprobs needs one value per response token of each conversation")
        algorithm = self.config.algorithm
        plan = self._plan(conversations)

        # Old log-probabilities through the first epoch's micro-batches, so that the first
        # mini-batch sees bitwise the same inputs; then those of the conversations this worker
        # meets only in later epochs.
        first_epoch = [micro for shard in plan[0] for micro in shard.micro_batches]
        seen = {index for micro in first_epoch for index in micro}
        later = sorted(
            {
                i
                for epoch in plan[1:]
                for shard in epoch
                for micro in shard.micro_batches
                for i in micro
            }
            - seen
        )
        lengths = [conversation.n_tokens for conversation in conversations]
        passes = first_epoch + _pack(later, lengths, self.config.micro_batch_tokens)
        own_tokens = sum(lengths[index] for micro in passes for index in micro)
        passed_tokens = own_tokens
        old = self._logprobs_by_micro_batch(self.policy, conversations, passes)
        if ref_logprobs is None and algorithm.kl_coef > 0:
            ref_logprobs = self._reference_logprobs(conversations, passes)
            passed_tokens += own_tokens
        reference = None if ref_logprobs is None else [lp.to(torch.float32) for lp in ref_logprobs]

        steps: list[MiniBatchMetrics] = []
        for epoch in plan:
            for shard in epoch:
                steps.append(self._optimizer_step(conversations, shard, advantages, old, reference))
                passed_tokens += sum(lengths[i] for micro in shard.micro_batches for i in micro)
        self.updates += 1
        # The first epoch's own conversations: each answered one on exactly one worker.
        owned = [
            i for shard in plan[0] if shard.weight for micro in shard.micro_batches for i in micro
        ]
        gap_sum, gap_count = _rollout_gap(conversations, old, owned)
        passed_tokens, gap_sum, gap_count = self._sum_over_workers(
            [passed_tokens, gap_sum, gap_count]
        )
        seconds = time.perf_counter() - started
        return StepMetrics(
            loss=sum(s.loss for s in steps) / len(steps),
            clip_fraction=_token_weighted(steps, "clip_fraction"),
            approx_kl=_token_weighted(steps, "approx_kl"),
            dual_clip_fraction=_token_weighted(steps, "dual_clip_fraction"),
            kl=_token_weighted(steps, "kl") if reference is not None else None,
            entropy=_token_weighted(steps, "entropy") if algorithm.entropy_coef > 0 else None,
            grad_norm=sum(s.grad_norm for s in steps) / len(steps),
            learning_rate=steps[-1].learning_rate,
            n_tokens=sum(len(conversation.response_ids) for conversation in conversations),
            n_conversations=n,
            optimizer_steps=len(steps),
            rollout_logprob_abs_diff=gap_sum / gap_count if gap_count else None,
            tokens_per_s=passed_tokens / seconds,
            seconds=seconds,
            mini_batches=tuple(steps),
            dtype=self.config.dtype,
        )

    def skip_batch(self) -> None:
        """Counts a rollout batch that carried no signal (every advantage 0) without an
        optimiser step: Adam would move every weight by about the learning rate on noise."""
        self.updates += 1

    def _optimizer_step(
        self,
        conversations: Sequence[Conversation],
        shard: Shard,
        advantages: Tensor,
        old: list[Tensor],
        reference: list[Tensor] | None,
    ) -> MiniBatchMetrics:
        algorithm = self.config.algorithm
        n_tokens = shard.n_tokens
        normalizer = float(max(n_tokens, 1))
        with_entropy = algorithm.entropy_coef > 0
        self.optimizer.zero_grad(set_to_none=True)
        loss_total = 0.0
        sums = {"clip_fraction": 0.0, "approx_kl": 0.0, "dual_clip_fraction": 0.0}
        kl_sum = entropy_sum = 0.0
        last = len(shard.micro_batches) - 1
        for position, micro in enumerate(shard.micro_batches):
            batch = [conversations[i] for i in micro]
            with self._gradient_sync(position == last):
                loss, stats_sums, kl, entropy_term = self._micro_batch_loss(
                    batch, [old[i] for i in micro], advantages[micro],
                    None if reference is None else [reference[i] for i in micro],
                    normalizer=normalizer, with_entropy=with_entropy,
                )  # fmt: skip
                loss = loss * shard.weight
                # DDP averages the workers' gradients; each holds its share of the sum.
                (loss * float(self.world_size)).backward()
            for name, value in stats_sums.items():
                sums[name] += value * shard.weight
            kl_sum += kl * shard.weight
            entropy_sum += entropy_term * shard.weight
            loss_total += float(loss.detach())
        loss_total, kl_sum, entropy_sum, *summed = self._sum_over_workers(
            [loss_total, kl_sum, entropy_sum, *sums.values()]
        )
        sums = dict(zip(sums, summed, strict=True))
        parameters = [p for p in self.model.parameters() if p.requires_grad]
        grad_norm = torch.nn.utils.clip_grad_norm_(parameters, self.config.grad_clip)
        learning_rate = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.global_step += 1
        share = float(max(n_tokens, 1))
        return MiniBatchMetrics(
            loss=loss_total,
            clip_fraction=sums["clip_fraction"] / share,
            approx_kl=sums["approx_kl"] / share,
            dual_clip_fraction=sums["dual_clip_fraction"] / share,
            kl=kl_sum if reference is not None else None,
            entropy=entropy_sum if with_entropy else None,
            grad_norm=float(grad_norm),
            learning_rate=learning_rate,
            n_tokens=n_tokens,
            n_conversations=shard.n_conversations,
        )

    def _micro_batch_loss(
        self,
        batch: Sequence[Conversation],
        old: list[Tensor],
        advantages: Tensor,
        reference: list[Tensor] | None,
        *,
        normalizer: float,
        with_entropy: bool,
    ) -> tuple[Tensor, dict[str, float], float, float]:
        """The micro-batch's share of its mini-batch's loss (the surrogate, plus the KL and
        minus the entropy terms when their coefficients are set), the token-weighted sums of its
        clip and approx-KL statistics, and its KL and entropy terms."""
        algorithm = self.config.algorithm
        logprobs, mask, entropy = self._forward(self.trained, batch, with_entropy=with_entropy)
        old_padded = _pad(old, logprobs.shape[1], self.device)
        loss, stats = clipped_token_loss(
            logprobs,
            old_padded,
            advantages.to(self.device),
            mask,
            clip_low=algorithm.clip_low,
            clip_high=algorithm.clip_high,
            dual_clip=algorithm.dual_clip,
            normalizer=normalizer,
        )
        stats_sums = {
            name: getattr(stats, name) * stats.n_tokens
            for name in ("clip_fraction", "approx_kl", "dual_clip_fraction")
        }
        kl_value = entropy_value = 0.0
        if reference is not None:
            ref_padded = _pad(reference, logprobs.shape[1], self.device)
            kl = token_mean(low_var_kl(logprobs, ref_padded), mask, normalizer=normalizer)
            kl_value = float(kl.detach())
            if algorithm.kl_coef > 0:
                loss = loss + algorithm.kl_coef * kl
        if entropy is not None:
            entropy_term = token_mean(entropy, mask, normalizer=normalizer)
            entropy_value = float(entropy_term.detach())
            loss = loss - algorithm.entropy_coef * entropy_term
        return loss, stats_sums, kl_value, entropy_value

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The forward's precision (its backward follows it): bfloat16 autocast over float32
        weights with `dtype` bfloat16, else nothing. `ResponseLogits` casts its logits back to
        float32, so the log-softmax, ratios and KL are float32 either way."""
        if self.config.dtype == "float32":
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)

    def _gradient_sync(self, sync: bool) -> contextlib.AbstractContextManager[Any]:
        """DDP's all-reduce on this backward only when `sync` (a worker's last micro-batch of
        the step); without DDP, nothing to hold back."""
        no_sync = getattr(self.trained, "no_sync", None)
        return contextlib.nullcontext() if sync or no_sync is None else no_sync()

    def _sum_over_workers(self, values: Sequence[float]) -> list[float]:
        if self.world_size == 1:
            return list(values)
        import torch.distributed as dist

        summed = torch.tensor(list(values), dtype=torch.float64, device=self.device)
        dist.all_reduce(summed)
        return summed.tolist()

    def _plan(self, conversations: Sequence[Conversation]) -> list[list[Shard]]:
        """Epochs of this worker's shards of the mini-batches. Every worker draws the same
        order (same seed, same generator state) and keeps its share; a conversation without
        response tokens adds nothing to the loss and joins no micro-batch."""
        n = len(conversations)
        lengths = [conversation.n_tokens for conversation in conversations]
        size = self.config.mini_batch_conversations
        plan = []
        for _ in range(self.config.epochs_per_batch):
            if self.config.shuffle:
                order = torch.randperm(n, generator=self.generator).tolist()
            else:
                order = list(range(n))
            epoch = []
            for start in range(0, n, size):
                mini_batch = order[start : start + size]
                answered = [i for i in mini_batch if conversations[i].response_ids]
                own = answered[self.rank :: self.world_size]
                weight = 1.0
                if not own and answered:
                    own, weight = answered[:1], 0.0
                epoch.append(
                    Shard(
                        micro_batches=_pack(own, lengths, self.config.micro_batch_tokens),
                        n_tokens=sum(len(conversations[i].response_ids) for i in answered),
                        n_conversations=len(mini_batch),
                        weight=weight,
                    )
                )
            plan.append(epoch)
        return plan

    def _reference_logprobs(
        self, conversations: Sequence[Conversation], micro_batches: list[list[int]]
    ) -> list[Tensor]:
        if self.reference is not None:
            return self._logprobs_by_micro_batch(self.reference, conversations, micro_batches)
        with self.model.disable_adapter():  # LoRA: the base weights are the reference
            return self._logprobs_by_micro_batch(self.policy, conversations, micro_batches)

    def _logprobs_by_micro_batch(
        self,
        model: torch.nn.Module,
        conversations: Sequence[Conversation],
        micro_batches: list[list[int]],
    ) -> list[Tensor]:
        result: list[Tensor] = [torch.empty(0)] * len(conversations)
        with torch.no_grad():
            for micro in micro_batches:
                logprobs, _, _ = self._forward(model, [conversations[i] for i in micro])
                for row, index in enumerate(micro):
                    length = len(conversations[index].response_ids)
                    result[index] = logprobs[row, :length].cpu()
        return result

    def _forward(
        self,
        model: torch.nn.Module,
        batch: Sequence[Conversation],
        *,
        with_entropy: bool = False,
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """Response log-probabilities [B, R] (0 past each response), their mask, and the
        entropy of each of those next-token distributions if asked, from `model`: a
        `ResponseLogits`, or its DDP wrapper."""
        longest = max(conversation.n_tokens for conversation in batch)
        longest_response = max(len(conversation.response_ids) for conversation in batch)
        input_ids = torch.zeros(len(batch), longest, dtype=torch.long)
        attention = torch.zeros(len(batch), longest, dtype=torch.long)
        rows, positions, slots = [], [], []
        for row, conversation in enumerate(batch):
            sequence = conversation.prompt_ids + conversation.response_ids
            input_ids[row, : len(sequence)] = torch.tensor(sequence)
            attention[row, : len(sequence)] = 1
            n_prompt, n_response = len(conversation.prompt_ids), len(conversation.response_ids)
            rows += [row] * n_response
            positions += range(n_prompt - 1, n_prompt - 1 + n_response)
            slots += range(n_response)
        shape = (len(batch), longest_response)
        mask = torch.zeros(shape, dtype=torch.bool, device=self.device)
        if not rows:
            empty = torch.zeros(shape, device=self.device)
            return empty, mask, (empty if with_entropy else None)
        input_ids, attention = input_ids.to(self.device), attention.to(self.device)
        row_index = torch.tensor(rows, device=self.device)
        position_index = torch.tensor(positions, device=self.device)
        slot_index = torch.tensor(slots, device=self.device)
        with self._autocast():
            logits = model(input_ids, attention, row_index, position_index)
        targets = input_ids[row_index, position_index + 1]
        all_logprobs = torch.log_softmax(logits, dim=-1)
        token_logprobs = all_logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        logprobs = torch.zeros(shape, device=self.device).index_put(
            (row_index, slot_index), token_logprobs
        )
        mask[row_index, slot_index] = True
        entropy = None
        if with_entropy:
            token_entropy = -(all_logprobs.exp() * all_logprobs).sum(-1)
            entropy = torch.zeros(shape, device=self.device).index_put(
                (row_index, slot_index), token_entropy
            )
        return logprobs, mask, entropy

    def save_checkpoint(self, directory: str | Path) -> Path:
        """Weights, tokenizer files, optimiser, scheduler, step counters and RNG state, written
        to a temporary folder and renamed into place: a kill mid-save leaves the previous
        checkpoint at `directory` (or, between the two renames, at `<directory>.previous`,
        which `resume` reads)."""

        def write(folder: Path) -> None:
            self._write_weights(folder)
            state = {
                "format": CHECKPOINT_FORMAT,
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "global_step": self.global_step,
                "updates": self.updates,
                "torch_rng": torch.get_rng_state(),
                "generator": self.generator.get_state(),
            }
            torch.save(state, folder / STATE_FILE)
            summary = {
                "format": CHECKPOINT_FORMAT,
                "global_step": self.global_step,
                "updates": self.updates,
                "config": self.config.model_dump(mode="json"),
            }
            (folder / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")

        return write_atomically(Path(directory), write)

    def export_weights(self, directory: str | Path) -> Path:
        """The current weights and tokenizer files, for the rollout engine to reload; no
        optimiser state. Written atomically like a checkpoint."""
        return write_atomically(Path(directory), self._write_weights)

    def _write_weights(self, folder: Path) -> None:
        if self.config.lora:
            self.model.save_pretrained(folder / ADAPTER_DIR)
            merged = copy.deepcopy(self.model).merge_and_unload()
            merged.save_pretrained(folder)
        else:
            self.model.save_pretrained(folder)
        for name in TOKENIZER_FILES:
            source = self.base_path / name
            if source.is_file():
                shutil.copy2(source, folder / name)


def append_metrics(path: str | Path, step: int, metrics: StepMetrics | Mapping[str, Any]) -> None:
    """Appends `{"step": step, **metrics}` as one JSON line to `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = metrics.to_dict() if isinstance(metrics, StepMetrics) else dict(metrics)
    with path.open("a", encoding="utf-8") as file:
        file.write(json.dumps({"step": step, **payload}) + "\n")
        file.flush()


def existing_checkpoint(directory: str | Path) -> Path | None:
    """The checkpoint `save_checkpoint(directory)` left: `directory`, or `<directory>.previous`
    if a save was killed between its two renames; None if neither holds one."""
    directory = Path(directory)
    if not directory.is_dir() and _previous(directory).is_dir():
        directory = _previous(directory)
    return directory if (directory / STATE_FILE).is_file() else None


def checkpoint_updates(directory: str | Path) -> int:
    """The rollout batches the checkpoint in `directory` has trained on (0 if none)."""
    found = existing_checkpoint(directory)
    if found is None:
        return 0
    return int(json.loads((found / SUMMARY_FILE).read_text())["updates"])


def _load_model(folder: Path, device: torch.device) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return model.to(device).eval()


def _import_peft() -> Any:
    try:
        import peft
    except ImportError as error:
        raise ImportError(
            "LoRA training needs peft, which is in memstream's `train` extra: "
            "pip install 'memstream[train]'"
        ) from error
    return peft


def _pack(indices: list[int], lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Micro-batches of `indices`, longest first, each at most `budget` padded tokens (a longer
    sequence alone)."""
    ordered = sorted(indices, key=lambda index: -lengths[index])
    micro_batches: list[list[int]] = []
    for index in ordered:
        current = micro_batches[-1] if micro_batches else None
        # Longest first, so the micro-batch's first member sets its padded length.
        if current and (len(current) + 1) * lengths[current[0]] <= budget:
            current.append(index)
        else:
            micro_batches.append([index])
    return micro_batches


def _pad(values: list[Tensor], width: int, device: torch.device) -> Tensor:
    padded = torch.zeros(len(values), width, device=device)
    for row, value in enumerate(values):
        padded[row, : value.numel()] = value.to(device)
    return padded


def _token_weighted(steps: Sequence[MiniBatchMetrics], name: str) -> float:
    total = sum(step.n_tokens for step in steps)
    return sum(getattr(step, name) * step.n_tokens for step in steps) / max(total, 1)


def _rollout_gap(
    conversations: Sequence[Conversation], old: list[Tensor], indices: Sequence[int]
) -> tuple[float, int]:
    """The sum of |engine - learner| old log-probabilities over the response tokens of the
    conversations `indices` names that the engine reported them for, and those tokens' count."""
    differences = [
        (torch.tensor(conversations[index].rollout_logprobs) - old[index]).abs()
        for index in indices
        if conversations[index].rollout_logprobs is not None
    ]
    if not differences:
        return 0.0, 0
    joined = torch.cat(differences)
    return float(joined.sum()), joined.numel()


def _previous(directory: Path) -> Path:
    return directory.with_name(directory.name + ".previous")


def write_atomically(directory: Path, write: Any) -> Path:
    """Calls `write(folder)` on a fresh temporary sibling of `directory`, syncs it to disk, and
    renames it into place, the old folder (if any) moved aside first and removed last."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    partial = directory.with_name(f".{directory.name}.partial-{os.getpid()}")
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir()
    try:
        write(partial)
        for file in partial.rglob("*"):
            if file.is_file():
                with file.open("rb") as handle:
                    os.fsync(handle.fileno())
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    previous = _previous(directory)
    if directory.exists():
        if previous.exists():
            shutil.rmtree(previous)
        directory.rename(previous)
    partial.rename(directory)
    _fsync_directory(directory.parent)
    if previous.exists():
        shutil.rmtree(previous)
    return directory


def _fsync_directory(directory: Path) -> None:
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
