"""The learner: a causal LM in fp32 trained on a rollout batch's conversations by Multi-Conv DAPO.

A rollout batch is a flat list of `Conversation`s (every update and final conversation of every
chain), each with the advantage of the chain it belongs to. `Learner.step` recomputes the old
log-probabilities with the current weights (so the ratio starts at exactly 1, whatever precision
the rollout engine ran in), then takes `epochs_per_batch` passes over the batch in mini-batches of
`mini_batch_conversations`, one optimiser step per mini-batch, so the later steps see a ratio away
from 1 and the clip acts. Forward passes run in micro-batches of right-padded sequences of at most
`micro_batch_tokens`, each scaled by its mini-batch's response-token count so that their gradients
add up to the mini-batch's token mean. Log-probabilities are computed only at response positions.

The model stays in eval mode (no dropout), so the training forward matches the no-grad one that
gave the old log-probabilities. `save_checkpoint` writes a folder that transformers and vLLM load
as a model, plus the optimiser, scheduler, step counters and RNG state; `export_weights` writes the
weights alone, for the rollout engine to reload.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import time
from collections.abc import Mapping, Sequence
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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Learner:
    """Holds the policy, its optimiser and scheduler, and (when kl_coef > 0) a frozen reference.

    `initial_weights` loads the policy from another folder than `config.model` (a checkpoint);
    the reference always comes from `config.model`.
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
        self.reference: torch.nn.Module | None = None
        if config.algorithm.kl_coef > 0 and not config.lora:
            self.reference = _load_model(base, self.device)
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
        directory = Path(directory)
        if not directory.is_dir() and _previous(directory).is_dir():
            directory = _previous(directory)
        if not (directory / STATE_FILE).is_file():
            raise FileNotFoundError(f"{directory} holds no learner checkpoint ({STATE_FILE})")
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
        return self._logprobs_by_micro_batch(self.model, conversations, micro_batches)

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
        plan = self._plan([conversation.n_tokens for conversation in conversations])
        batch_tokens = sum(conversation.n_tokens for conversation in conversations)
        passed_tokens = batch_tokens

        # The first epoch's micro-batches, so the first mini-batch sees bitwise the same inputs.
        first_epoch = [micro for mini in plan[0] for micro in mini]
        old = self._logprobs_by_micro_batch(self.model, conversations, first_epoch)
        if ref_logprobs is None and algorithm.kl_coef > 0:
            ref_logprobs = self._reference_logprobs(conversations, first_epoch)
            passed_tokens += batch_tokens
        reference = None if ref_logprobs is None else [lp.to(torch.float32) for lp in ref_logprobs]

        steps: list[MiniBatchMetrics] = []
        for epoch in plan:
            for mini_batch in epoch:
                steps.append(
                    self._optimizer_step(conversations, mini_batch, advantages, old, reference)
                )
                passed_tokens += sum(
                    conversations[i].n_tokens for micro in mini_batch for i in micro
                )
        self.updates += 1
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
            rollout_logprob_abs_diff=_rollout_gap(conversations, old),
            tokens_per_s=passed_tokens / seconds,
            seconds=seconds,
            mini_batches=tuple(steps),
        )

    def skip_batch(self) -> None:
        """Counts a rollout batch that carried no signal (every advantage 0) without an
        optimiser step: Adam would move every weight by about the learning rate on noise."""
        self.updates += 1

    def _optimizer_step(
        self,
        conversations: Sequence[Conversation],
        mini_batch: list[list[int]],
        advantages: Tensor,
        old: list[Tensor],
        reference: list[Tensor] | None,
    ) -> MiniBatchMetrics:
        algorithm = self.config.algorithm
        n_tokens = sum(len(conversations[i].response_ids) for micro in mini_batch for i in micro)
        normalizer = float(max(n_tokens, 1))
        with_entropy = algorithm.entropy_coef > 0
        self.optimizer.zero_grad(set_to_none=True)
        loss_total = 0.0
        sums = {"clip_fraction": 0.0, "approx_kl": 0.0, "dual_clip_fraction": 0.0}
        kl_sum = entropy_sum = 0.0
        for micro in mini_batch:
            batch = [conversations[i] for i in micro]
            logprobs, mask, entropy = self._forward(self.model, batch, with_entropy=with_entropy)
            old_padded = _pad([old[i] for i in micro], logprobs.shape[1], self.device)
            loss, stats = clipped_token_loss(
                logprobs,
                old_padded,
                advantages[micro].to(self.device),
                mask,
                clip_low=algorithm.clip_low,
                clip_high=algorithm.clip_high,
                dual_clip=algorithm.dual_clip,
                normalizer=normalizer,
            )
            for name in sums:
                sums[name] += getattr(stats, name) * stats.n_tokens
            if reference is not None:
                ref_padded = _pad([reference[i] for i in micro], logprobs.shape[1], self.device)
                kl = token_mean(low_var_kl(logprobs, ref_padded), mask, normalizer=normalizer)
                kl_sum += float(kl.detach())
                if algorithm.kl_coef > 0:
                    loss = loss + algorithm.kl_coef * kl
            if entropy is not None:
                entropy_term = token_mean(entropy, mask, normalizer=normalizer)
                entropy_sum += float(entropy_term.detach())
                loss = loss - algorithm.entropy_coef * entropy_term
            if mask.any():
                loss.backward()
            loss_total += float(loss.detach())
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
            n_conversations=sum(len(micro) for micro in mini_batch),
        )

    def _plan(self, lengths: list[int]) -> list[list[list[list[int]]]]:
        """Epochs of mini-batches of micro-batches of conversation indices."""
        n = len(lengths)
        size = self.config.mini_batch_conversations
        plan = []
        for _ in range(self.config.epochs_per_batch):
            if self.config.shuffle:
                order = torch.randperm(n, generator=self.generator).tolist()
            else:
                order = list(range(n))
            mini_batches = [order[start : start + size] for start in range(0, n, size)]
            plan.append(
                [_pack(mini, lengths, self.config.micro_batch_tokens) for mini in mini_batches]
            )
        return plan

    def _reference_logprobs(
        self, conversations: Sequence[Conversation], micro_batches: list[list[int]]
    ) -> list[Tensor]:
        if self.reference is not None:
            return self._logprobs_by_micro_batch(self.reference, conversations, micro_batches)
        with self.model.disable_adapter():  # LoRA: the base weights are the reference
            return self._logprobs_by_micro_batch(self.model, conversations, micro_batches)

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
        entropy of each of those next-token distributions if asked. The LM head runs only on the
        hidden states that predict a response token."""
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
        hidden = model.get_decoder()(
            input_ids=input_ids, attention_mask=attention, use_cache=False
        ).last_hidden_state
        logits = model.get_output_embeddings()(hidden[row_index, position_index]).float()
        softcap = getattr(model.config, "final_logit_softcapping", None)
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        if self.config.temperature != 1.0:
            logits = logits / self.config.temperature
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

        return _write_atomically(Path(directory), write)

    def export_weights(self, directory: str | Path) -> Path:
        """The current weights and tokenizer files, for the rollout engine to reload; no
        optimiser state. Written atomically like a checkpoint."""
        return _write_atomically(Path(directory), self._write_weights)

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


def _rollout_gap(conversations: Sequence[Conversation], old: list[Tensor]) -> float | None:
    differences = [
        (torch.tensor(conversation.rollout_logprobs) - logprobs).abs()
        for conversation, logprobs in zip(conversations, old, strict=True)
        if conversation.rollout_logprobs is not None and conversation.response_ids
    ]
    if not differences:
        return None
    return float(torch.cat(differences).mean())


def _previous(directory: Path) -> Path:
    return directory.with_name(directory.name + ".previous")


def _write_atomically(directory: Path, write: Any) -> Path:
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
