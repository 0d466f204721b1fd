"""Multi-Conv DAPO as pure functions on fp32 tensors: no I/O, no engine, no model.

A sample's rollout is a memory chain of K update conversations and one final conversation. Its
reward is the final answer's, the group of G rollouts of one sample gives each rollout an
advantage (`group_advantages`), and that scalar is tiled over every response token of every
conversation of the chain (`broadcast_to_conversations`, then `clipped_token_loss`). The loss is a
token mean over all response tokens of the batch, so long conversations weigh by their length.

The semantics follow verl's `verl/trainer/ppo/core_algos.py` (`compute_grpo_outcome_advantage`,
`compute_policy_loss`, `kl_penalty`, `agg_loss`) as bundled with the MemAgent reference, with two
deliberate differences: a group of one rollout gets advantage 0 (verl gives it the raw reward,
having no baseline), and `keep_informative_groups` drops such groups (verl keeps them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor

from pipeline.training.config import PresetName

# verl's stability clamps: the log-ratio before `exp`, and the k3 estimate itself.
MAX_ABS_LOG_RATIO = 20.0
MAX_ABS_LOW_VAR_KL = 10.0


def group_advantages(
    rewards: Tensor, group_ids: Tensor, *, normalize_std: bool, eps: float = 1e-6
) -> Tensor:
    """Each rollout's reward minus its group's mean, divided by the group's unbiased standard
    deviation plus `eps` when `normalize_std` (GRPO), else not (Dr.GRPO; the MemAgent scripts'
    `grpo_use_adv=False`). A group whose rewards are all equal gets 0, and so does a group of
    one."""
    rewards = rewards.to(torch.float32)
    if rewards.dim() != 1 or group_ids.shape != rewards.shape:
        raise ValueError(
            f"rewards and group_ids must be 1-D of one length, got {tuple(rewards.shape)} "
            f"and {tuple(group_ids.shape)}"
        )
    _, group_of = torch.unique(group_ids, return_inverse=True)
    n_groups = int(group_of.max()) + 1 if group_of.numel() else 0
    sizes = torch.bincount(group_of, minlength=n_groups).to(torch.float32)
    sums = torch.zeros(n_groups, dtype=torch.float32).index_add_(0, group_of, rewards)
    means = sums / sizes
    # A group of one is its own mean, so it gets 0 here, where verl (mean 0, std 1) gives r.
    centered = rewards - means[group_of]
    if not normalize_std:
        return centered
    squares = torch.zeros(n_groups, dtype=torch.float32).index_add_(0, group_of, centered**2)
    stds = torch.sqrt(squares / (sizes - 1).clamp(min=1))
    return centered / (stds[group_of] + eps)


def broadcast_to_conversations(sample_advantages: Tensor, sample_index: Tensor) -> Tensor:
    """The advantage of each conversation: its sample's. `sample_index[i]` is the position, in
    `sample_advantages`, of the rollout that conversation i belongs to (its K updates and its
    final conversation share one index)."""
    if sample_index.is_floating_point():
        raise TypeError("sample_index must hold integers")
    if sample_index.numel() and (
        int(sample_index.min()) < 0 or int(sample_index.max()) >= sample_advantages.shape[0]
    ):
        raise IndexError(
            f"sample_index must lie in [0, {sample_advantages.shape[0]}), "
            f"got [{int(sample_index.min())}, {int(sample_index.max())}]"
        )
    return sample_advantages.to(torch.float32)[sample_index.long()]


def token_mean(values: Tensor, mask: Tensor, *, normalizer: float | None = None) -> Tensor:
    """The sum of `values` over the masked positions divided by their count, or by `normalizer`
    when given: a micro-batch divided by its whole mini-batch's token count, so that the
    micro-batches' losses add up to the mini-batch's token mean. Unmasked positions never enter,
    even if they hold inf or nan. An empty mask gives 0."""
    selected = mask.to(torch.bool)
    total = torch.where(selected, values.to(torch.float32), 0.0).sum()
    if normalizer is None:
        return total / max(float(selected.sum()), 1.0)
    if normalizer <= 0:
        raise ValueError(f"normalizer must be positive, got {normalizer}")
    return total / normalizer


@dataclass(frozen=True)
class PolicyLossStats:
    """Shares over the masked tokens of one call (verl's `pg_clipfrac`, `ppo_kl`,
    `pg_clipfrac_lower`)."""

    clip_fraction: float  # tokens where the clipped term is the larger loss, so the clip binds
    approx_kl: float  # mean of old - new log-probability
    dual_clip_fraction: float  # tokens with A < 0 whose loss the dual clip caps at -c * A
    n_tokens: int


def clipped_token_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    dual_clip: float | None = 3.0,
    normalizer: float | None = None,
) -> tuple[Tensor, PolicyLossStats]:
    """The PPO surrogate with decoupled clips, as a token mean.

    Per token, with rho = exp(logprob - old_logprob) and the conversation's advantage A:
    loss = max(-rho·A, -clip(rho, 1 - clip_low, 1 + clip_high)·A), and for A < 0 with a dual clip c,
    min(that, -c·A). `logprobs`, `old_logprobs` and `response_mask` are [n_conversations, T],
    `advantages` [n_conversations]. See `token_mean` for `normalizer`.
    """
    if logprobs.shape != old_logprobs.shape or logprobs.shape != response_mask.shape:
        raise ValueError(
            "logprobs, old_logprobs and response_mask must share one shape, got "
            f"{tuple(logprobs.shape)}, {tuple(old_logprobs.shape)}, {tuple(response_mask.shape)}"
        )
    if advantages.shape != logprobs.shape[:1]:
        raise ValueError(
            f"advantages must be [n_conversations] = [{logprobs.shape[0]}], "
            f"got {tuple(advantages.shape)}"
        )
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be above 1, got {dual_clip}")
    mask = response_mask.to(torch.bool)
    log_ratio = torch.where(mask, logprobs.to(torch.float32) - old_logprobs.to(torch.float32), 0.0)
    ratio = torch.exp(log_ratio.clamp(-MAX_ABS_LOG_RATIO, MAX_ABS_LOG_RATIO))
    advantage = advantages.to(torch.float32).unsqueeze(-1)
    unclipped = -advantage * ratio
    clipped = -advantage * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    losses = torch.maximum(unclipped, clipped)
    dual_clipped = torch.zeros_like(mask)
    if dual_clip is not None:
        cap = -advantage * dual_clip
        negative = (advantage < 0).expand_as(losses)
        dual_clipped = negative & (losses > cap)
        losses = torch.where(negative, torch.minimum(losses, cap), losses)
    loss = token_mean(losses, mask, normalizer=normalizer)
    with torch.no_grad():
        stats = PolicyLossStats(
            clip_fraction=float(token_mean((clipped > unclipped).float(), mask)),
            approx_kl=float(token_mean(-log_ratio, mask)),
            dual_clip_fraction=float(token_mean(dual_clipped.float(), mask)),
            n_tokens=int(mask.sum()),
        )
    return loss, stats


def low_var_kl(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Per-token k3 estimate of KL(policy ‖ reference): exp(ref - new) - (ref - new) - 1, clamped
    to ±10 as verl's `kl_penalty(..., "low_var_kl")`. Aggregate it with `token_mean`."""
    difference = (ref_logprobs.to(torch.float32) - logprobs.to(torch.float32)).clamp(
        -MAX_ABS_LOG_RATIO, MAX_ABS_LOG_RATIO
    )
    estimate = torch.exp(difference) - difference - 1.0
    return estimate.clamp(-MAX_ABS_LOW_VAR_KL, MAX_ABS_LOW_VAR_KL)


def keep_informative_groups(rewards: Tensor, group_ids: Tensor) -> tuple[Tensor, list[int]]:
    """DAPO's dynamic-sampling filter: a group teaches something only if its rewards differ
    (for 0/1 rewards, 0 < #correct < n; a group of one never does). Returns the per-rollout keep
    mask and the kept group ids in ascending order."""
    if rewards.dim() != 1 or group_ids.shape != rewards.shape:
        raise ValueError("rewards and group_ids must be 1-D of one length")
    groups, group_of = torch.unique(group_ids, return_inverse=True)
    n_groups = groups.numel()
    values = rewards.to(torch.float32)
    highest = torch.full((n_groups,), -torch.inf).scatter_reduce(0, group_of, values, "amax")
    lowest = torch.full((n_groups,), torch.inf).scatter_reduce(0, group_of, values, "amin")
    informative = highest > lowest
    kept = [int(group) for group in groups[informative].tolist()]
    return informative[group_of], kept


def overlong_penalty(lengths: Tensor, *, max_length: int, cache_length: int) -> Tensor:
    """DAPO's soft length penalty: 0 up to `max_length - cache_length` tokens, then falling
    linearly to -1 at `max_length`, and -1 beyond it."""
    if not 0 < cache_length <= max_length:
        raise ValueError(
            f"need 0 < cache_length <= max_length, got {cache_length} and {max_length}"
        )
    lengths = lengths.to(torch.float32)
    free = float(max_length - cache_length)
    inside_cache = (free - lengths) / cache_length
    penalty = torch.where(lengths <= free, 0.0, inside_cache)
    return torch.where(lengths > max_length, -1.0, penalty)


class TrainingAlgorithmConfig(BaseModel):
    """The algorithm's knobs. Start from a preset (`TrainingAlgorithmConfig.preset("dapo")`) and
    override any of them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    clip_low: float = Field(
        0.2, ge=0.0, lt=1.0, description="eps_low: the ratio is clipped below at 1 - eps_low."
    )
    clip_high: float = Field(
        0.28,
        ge=0.0,
        description="eps_high: the ratio is clipped above at 1 + eps_high (DAPO's clip-higher).",
    )
    dual_clip: float | None = Field(
        3.0,
        gt=1.0,
        description="c of dual-clip PPO: for negative advantages the per-token loss is at most "
        "-c·A. None turns it off.",
    )
    kl_coef: float = Field(
        0.0,
        ge=0.0,
        description="Weight of the KL loss to the reference policy (MemAgent scripts: 1e-3). "
        "0 means no reference model is needed.",
    )
    kl_estimator: Literal["low_var_kl"] = Field(
        "low_var_kl", description="KL estimator: k3 (`low_var_kl`), clamped to ±10 as in verl."
    )
    entropy_coef: float = Field(
        0.0, ge=0.0, description="Weight of the entropy bonus (0 in both references)."
    )
    normalize_advantage_std: bool = Field(
        True,
        description="Divide the group-centred reward by the group's std + 1e-6 (GRPO, DAPO); "
        "False keeps r - mean (the MemAgent scripts' grpo_use_adv=False).",
    )
    dynamic_sampling: bool = Field(
        False,
        description="Drop groups whose rewards are all equal and draw more samples until the "
        "batch is full (DAPO).",
    )
    max_draws: int = Field(
        10,
        ge=1,
        description="With dynamic sampling, the most generation rounds for one batch (DAPO: 10).",
    )
    overlong_shaping: bool = Field(
        False,
        description="Add DAPO's soft overlong penalty to the reward of replies that come near "
        "their token limit (for memory updates, the memory budget).",
    )
    overlong_cache_tokens: int = Field(
        256,
        ge=1,
        description="L_cache: how many tokens before the limit the penalty starts (DAPO: 4,096 of "
        "20,480).",
    )
    group_size: int = Field(
        16,
        ge=1,
        description="Rollouts per sample, G (16 in both references); advantages need G ≥ 2.",
    )

    @classmethod
    def preset(cls, name: PresetName, **overrides: Any) -> TrainingAlgorithmConfig:
        """A named preset with any field overridden; unknown names and fields are errors."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}: choose one of {sorted(PRESETS)}")
        return cls.model_validate({**PRESETS[name], **overrides})


PRESETS: dict[str, dict[str, Any]] = {
    # The MemAgent reference scripts (run_memory_7B.sh, run_memory_14B.sh).
    "memagent": {
        "clip_low": 0.2,
        "clip_high": 0.2,
        "dual_clip": 3.0,
        "kl_coef": 1e-3,
        "kl_estimator": "low_var_kl",
        "entropy_coef": 0.0,
        "normalize_advantage_std": False,
        "dynamic_sampling": False,
        "overlong_shaping": False,
        "group_size": 16,
    },
    # DAPO (arXiv 2503.14476); the dual clip keeps verl's default, which the paper does not set.
    "dapo": {
        "clip_low": 0.2,
        "clip_high": 0.28,
        "dual_clip": 3.0,
        "kl_coef": 0.0,
        "kl_estimator": "low_var_kl",
        "entropy_coef": 0.0,
        "normalize_advantage_std": True,
        "dynamic_sampling": True,
        "max_draws": 10,
        "overlong_shaping": True,
        "group_size": 16,
    },
}
