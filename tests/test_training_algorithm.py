"""pipeline.training.algorithm against numbers worked out by hand, the arithmetic in comments."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from pipeline.training.algorithm import (
    PRESETS,
    TrainingAlgorithmConfig,
    broadcast_to_conversations,
    clipped_token_loss,
    group_advantages,
    keep_informative_groups,
    low_var_kl,
    overlong_penalty,
    token_mean,
)

# Groups, interleaved on purpose: 7 -> [1, 0, 0, 0], 3 -> [1, 1, 1], 5 -> [1] alone, 9 -> [1, 0].
REWARDS = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0])
GROUPS = torch.tensor([7, 3, 7, 5, 7, 3, 7, 3, 9, 9])


def close(actual: torch.Tensor, expected: list, tol: float = 1e-5) -> None:
    """Equal in shape and within `tol` of the literal numbers."""
    assert actual.dtype == torch.float32
    torch.testing.assert_close(actual, torch.tensor(expected), rtol=0.0, atol=tol)


def test_advantage_without_std_is_reward_minus_group_mean() -> None:
    # group 7: mean 0.25 -> 0.75, -0.25, -0.25, -0.25; group 3: mean 1 -> 0; group 5 alone -> 0;
    # group 9: mean 0.5 -> 0.5, -0.5.
    advantages = group_advantages(REWARDS, GROUPS, normalize_std=False)
    close(advantages, [0.75, 0.0, -0.25, 0.0, -0.25, 0.0, -0.25, 0.0, 0.5, -0.5])


def test_advantage_with_std_uses_the_unbiased_std() -> None:
    # group 7: squares 0.5625 + 3 * 0.0625 = 0.75, / (4 - 1) = 0.25, std 0.5:
    #   0.75 / 0.500001 = 1.499997, -0.25 / 0.500001 = -0.499999 (a biased std, 0.433, gives 1.732)
    # group 9: squares 0.25 + 0.25 = 0.5, / (2 - 1), std 0.707107: +-0.5 / 0.707108 = +-0.707106
    # groups 3 (std 0) and 5 (alone): 0.
    advantages = group_advantages(REWARDS, GROUPS, normalize_std=True)
    close(
        advantages,
        [1.499997, 0.0, -0.499999, 0.0, -0.499999, 0.0, -0.499999, 0.0, 0.707106, -0.707106],
    )


def test_a_group_of_equal_rewards_gets_zero_advantage_and_is_filtered_out() -> None:
    rewards = torch.tensor([0.0, 0.0, 0.0, 1.0, 1.0])
    groups = torch.tensor([1, 1, 1, 2, 2])
    for normalize_std in (False, True):
        close(group_advantages(rewards, groups, normalize_std=normalize_std), [0.0] * 5)
    keep, kept = keep_informative_groups(rewards, groups)
    assert keep.tolist() == [False] * 5
    assert kept == []


def test_the_filter_keeps_only_groups_with_some_but_not_all_correct() -> None:
    # 4 -> [1, 0] kept; 2 -> all 1; 6 -> all 0; 8 alone; 3 -> [0, 1, 0] as floats, kept.
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0])
    groups = torch.tensor([4, 4, 2, 2, 2, 6, 6, 6, 8, 3, 3, 3])
    keep, kept = keep_informative_groups(rewards, groups)
    assert keep.tolist() == [True, True] + [False] * 7 + [True, True, True]
    assert kept == [3, 4]


def test_broadcast_gives_every_conversation_its_samples_advantage() -> None:
    # Three chains: sample 0 has updates at 0 and 3 and its final at 6, and so on.
    sample_advantages = torch.tensor([0.5, -0.5, 2.0])
    sample_index = torch.tensor([0, 1, 2, 0, 2, 2, 0, 1, 2])
    close(
        broadcast_to_conversations(sample_advantages, sample_index),
        [0.5, -0.5, 2.0, 0.5, 2.0, 2.0, 0.5, -0.5, 2.0],
    )
    with pytest.raises(IndexError):
        broadcast_to_conversations(sample_advantages, torch.tensor([0, 3]))
    with pytest.raises(TypeError):
        broadcast_to_conversations(sample_advantages, torch.tensor([0.0, 1.0]))


def two_token_example(ratios: list[float], advantage: float) -> tuple[torch.Tensor, ...]:
    """One conversation of two response tokens and one padded position holding garbage."""
    old = torch.tensor([[math.log(0.5), math.log(0.25), 0.0]])
    new = old.clone()
    new[0, :2] += torch.log(torch.tensor(ratios))
    new[0, 2] = float("inf")
    new.requires_grad_(True)
    mask = torch.tensor([[1, 1, 0]])
    return new, old, torch.tensor([advantage]), mask


def test_gradient_of_a_two_token_example_with_one_clipped_token() -> None:
    # A = +1. Token 1: rho = 1.1, inside [0.8, 1.28]: loss -1.1, d loss / d logprob = -rho * A.
    # Token 2: rho = 1.5 > 1.28: max(-1.5, -1.28) = -1.28, a constant: gradient 0.
    # Token mean over 2 tokens: (-1.1 - 1.28) / 2 = -1.19; gradients -1.1 / 2 = -0.55 and 0.
    new, old, advantages, mask = two_token_example([1.1, 1.5], advantage=1.0)
    loss, stats = clipped_token_loss(new, old, advantages, mask, clip_low=0.2, clip_high=0.28)
    loss.backward()
    assert loss.item() == pytest.approx(-1.19, abs=1e-6)
    assert new.grad is not None
    close(new.grad, [[-0.55, 0.0, 0.0]], tol=1e-6)
    assert stats.clip_fraction == pytest.approx(0.5)
    # old - new: -(ln 1.1 + ln 1.5) / 2 = -(0.0953102 + 0.4054651) / 2
    assert stats.approx_kl == pytest.approx(-0.2503876, abs=1e-6)
    assert stats.dual_clip_fraction == 0.0
    assert stats.n_tokens == 2


def test_gradient_of_a_two_token_example_with_a_negative_advantage() -> None:
    # A = -1. Token 1: rho = 0.7 < 0.8: max(0.7, 0.8) = 0.8, a constant: gradient 0.
    # Token 2: rho = 1.2, inside: loss 1.2, gradient -rho * A = 1.2, / 2 tokens = 0.6.
    # Loss (0.8 + 1.2) / 2 = 1.0. The dual clip (3 * 1 = 3) is above both: inactive.
    new, old, advantages, mask = two_token_example([0.7, 1.2], advantage=-1.0)
    loss, stats = clipped_token_loss(new, old, advantages, mask, clip_low=0.2, clip_high=0.28)
    loss.backward()
    assert loss.item() == pytest.approx(1.0, abs=1e-6)
    assert new.grad is not None
    close(new.grad, [[0.0, 0.6, 0.0]], tol=1e-6)
    assert stats.clip_fraction == pytest.approx(0.5)
    assert stats.dual_clip_fraction == 0.0


def test_clip_high_is_decoupled_from_clip_low() -> None:
    # rho = 1.25 with A = +1: inside 1 + 0.28 (loss -1.25), clipped by 1 + 0.2 (loss -1.2).
    new, old, advantages, mask = two_token_example([1.25, 1.25], advantage=1.0)
    dapo_loss, dapo_stats = clipped_token_loss(new, old, advantages, mask, clip_high=0.28)
    memagent_loss, memagent_stats = clipped_token_loss(new, old, advantages, mask, clip_high=0.2)
    assert dapo_loss.item() == pytest.approx(-1.25, abs=1e-6)
    assert memagent_loss.item() == pytest.approx(-1.2, abs=1e-6)
    assert (dapo_stats.clip_fraction, memagent_stats.clip_fraction) == (0.0, 1.0)


def test_dual_clip_caps_the_loss_of_negative_advantages_only() -> None:
    # Two one-token conversations at rho = 4.
    # A = -1: max(4, 1.28) = 4, capped at min(4, 3 * 1) = 3: a constant, gradient 0.
    # A = +1: max(-4, -1.28) = -1.28; no cap for A > 0 (min(-1.28, -3) would give -3).
    # Mean (3 - 1.28) / 2 = 0.86. Without the dual clip: (4 - 1.28) / 2 = 1.36, and the first
    # token's gradient is -rho * A / 2 = 2.
    old = torch.tensor([[math.log(0.2)], [math.log(0.2)]])
    new = (old + math.log(4.0)).requires_grad_(True)
    advantages = torch.tensor([-1.0, 1.0])
    mask = torch.ones(2, 1)
    loss, stats = clipped_token_loss(new, old, advantages, mask, dual_clip=3.0)
    loss.backward()
    assert loss.item() == pytest.approx(0.86, abs=1e-5)
    assert new.grad is not None
    close(new.grad, [[0.0], [0.0]])
    assert stats.dual_clip_fraction == pytest.approx(0.5)
    assert stats.clip_fraction == pytest.approx(0.5)  # only the A = +1 token: -1.28 > -4

    new.grad = None
    loss, stats = clipped_token_loss(new, old, advantages, mask, dual_clip=None)
    loss.backward()
    assert loss.item() == pytest.approx(1.36, abs=1e-5)
    close(new.grad, [[2.0], [0.0]])
    assert stats.dual_clip_fraction == 0.0
    with pytest.raises(ValueError):
        clipped_token_loss(new, old, advantages, mask, dual_clip=1.0)


def test_token_mean_weighs_long_conversations_by_their_token_count() -> None:
    # At rho = 1 each token's loss is -A. Conversation 0: A = 1, 3 tokens (-1 each);
    # conversation 1: A = -2, 1 token (+2). Token mean (-3 + 2) / 4 = -0.25, where a mean over
    # conversations would give (-1 + 2) / 2 = 0.5. Gradients -A / 4: -0.25 and 0.5.
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5, 0.5], [0.5, 0.5, 0.5, 0.5]]))
    new = old.clone().requires_grad_(True)
    advantages = torch.tensor([1.0, -2.0])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    loss, stats = clipped_token_loss(new, old, advantages, mask)
    loss.backward()
    assert loss.item() == pytest.approx(-0.25, abs=1e-6)
    assert new.grad is not None
    close(new.grad, [[-0.25, -0.25, -0.25, 0.0], [0.5, 0.0, 0.0, 0.0]])
    assert (stats.clip_fraction, stats.approx_kl, stats.n_tokens) == (0.0, 0.0, 4)

    # As two micro-batches divided by the mini-batch's 4 tokens: -3 / 4 + 2 / 4 = -0.25.
    first, _ = clipped_token_loss(new[:1], old[:1], advantages[:1], mask[:1], normalizer=4)
    second, _ = clipped_token_loss(new[1:], old[1:], advantages[1:], mask[1:], normalizer=4)
    assert (first.item(), second.item()) == pytest.approx((-0.75, 0.5), abs=1e-6)


def test_token_mean_ignores_masked_garbage_and_an_empty_mask_gives_zero() -> None:
    values = torch.tensor([[1.0, 2.0, float("nan")], [4.0, float("inf"), 6.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    # (1 + 2 + 4 + 6) / 4 = 3.25
    assert token_mean(values, mask).item() == pytest.approx(3.25)
    assert token_mean(values, mask, normalizer=10).item() == pytest.approx(1.3)
    assert token_mean(values, torch.zeros_like(mask)).item() == 0.0


def test_low_var_kl_is_the_clamped_k3_estimator() -> None:
    logprobs = torch.tensor([math.log(0.5), math.log(0.3), 0.0, -15.0])
    ref = torch.tensor([math.log(0.25), math.log(0.3), -15.0, 0.0])
    # d = ref - new. Token 1: d = ln 0.5 = -0.693147: 0.5 + 0.693147 - 1 = 0.193147.
    # Token 2: d = 0 -> 0. Token 3: d = -15: e^-15 + 15 - 1 = 14.0000003 -> clamped to 10.
    # Token 4: d = +15: e^15 - 16 = 3269001.4 -> clamped to 10.
    close(low_var_kl(logprobs, ref), [0.193147, 0.0, 10.0, 10.0])
    # Masked to the first two tokens: (0.193147 + 0) / 2
    mask = torch.tensor([1, 1, 0, 0])
    assert token_mean(low_var_kl(logprobs, ref), mask).item() == pytest.approx(0.0965736, abs=1e-6)


def test_overlong_penalty_in_its_three_regions() -> None:
    # L_max 100, L_cache 20: free up to 80; then (80 - |y|) / 20; -1 past 100.
    lengths = torch.tensor([50, 80, 81, 90, 100, 101, 150])
    close(
        overlong_penalty(lengths, max_length=100, cache_length=20),
        [0.0, 0.0, -0.05, -0.5, -1.0, -1.0, -1.0],
    )
    with pytest.raises(ValueError):
        overlong_penalty(lengths, max_length=100, cache_length=0)


def test_presets_hold_the_reference_values() -> None:
    memagent = TrainingAlgorithmConfig.preset("memagent")
    assert (memagent.clip_low, memagent.clip_high, memagent.dual_clip) == (0.2, 0.2, 3.0)
    assert (memagent.kl_coef, memagent.kl_estimator) == (1e-3, "low_var_kl")
    assert memagent.normalize_advantage_std is False
    assert (memagent.dynamic_sampling, memagent.overlong_shaping) == (False, False)
    assert (memagent.entropy_coef, memagent.group_size) == (0.0, 16)

    dapo = TrainingAlgorithmConfig.preset("dapo")
    assert (dapo.clip_low, dapo.clip_high, dapo.kl_coef) == (0.2, 0.28, 0.0)
    assert dapo.normalize_advantage_std is True
    assert (dapo.dynamic_sampling, dapo.max_draws, dapo.overlong_shaping) == (True, 10, True)
    assert sorted(PRESETS) == ["dapo", "memagent"]


def test_every_knob_can_be_overridden_and_bad_values_are_refused() -> None:
    config = TrainingAlgorithmConfig.preset("dapo", clip_high=0.3, group_size=4, dual_clip=None)
    assert (config.clip_high, config.group_size, config.dual_clip) == (0.3, 4, None)
    assert config.dynamic_sampling is True
    for bad in ({"clip_low": 1.5}, {"dual_clip": 0.5}, {"unknown_knob": 1}, {"max_draws": 0}):
        with pytest.raises(ValidationError):
            TrainingAlgorithmConfig.preset("memagent", **bad)
    with pytest.raises(ValueError, match="unknown preset"):
        TrainingAlgorithmConfig.preset("ppo")  # type: ignore[arg-type]
    for name in TrainingAlgorithmConfig.model_fields:
        assert TrainingAlgorithmConfig.model_fields[name].description, name
