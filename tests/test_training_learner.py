"""pipeline.training.learner on the real SmolLM2-135M in fp32, with prompts of about 20 tokens
and replies of about 5, so that every test runs in seconds on two CPU cores."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pipeline.training.algorithm import TrainingAlgorithmConfig
from pipeline.training.learner import (
    STATE_FILE,
    Conversation,
    Learner,
    LearnerConfig,
    append_metrics,
    write_atomically,
)

TEXTS = [
    ("Remember this for later: the access code of the blue door is 4417.", " The code is 4417."),
    ("Read the note and keep the fact. The ship leaves at dawn.", " It leaves at dawn"),
    ("Question: which city hosts the archive? Memory: the archive is in Lyon.", " Lyon"),
    ("Update the memory with the new fact: the key is under the mat by the door.", " key: mat"),
]


@pytest.fixture(scope="module")
def conversations(tokenizer) -> list[Conversation]:  # type: ignore[no-untyped-def]
    return [
        Conversation(
            sample_index=index // 2,
            prompt_ids=tuple(tokenizer(prompt)["input_ids"]),
            response_ids=tuple(tokenizer(response)["input_ids"]),
        )
        for index, (prompt, response) in enumerate(TEXTS)
    ]


def make_learner(model: str, **overrides: object) -> Learner:
    settings: dict[str, object] = {"model": model, "learning_rate": 1e-4, "warmup_steps": 0}
    return Learner(LearnerConfig.model_validate({**settings, **overrides}))


# float32 log-probabilities of one sequence, through kernels of different shapes (a padded batch,
# one row, a plain forward): 1.08e-5 apart at most measured on an Intel Xeon with AMX, less on
# AMD EPYCs. A masking or position error moves them far more.
LOGPROB_ATOL = 1e-4


def plain_logprobs(
    model: torch.nn.Module, conversation: Conversation, temperature: float = 1.0
) -> torch.Tensor:
    """One unpadded full forward, log_softmax over every position, then the response's."""
    ids = torch.tensor([conversation.prompt_ids + conversation.response_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float() / temperature
    start = len(conversation.prompt_ids) - 1
    predicting = torch.log_softmax(logits, dim=-1)[start:-1]
    return predicting.gather(-1, ids[0, start + 1 :].unsqueeze(-1)).squeeze(-1)


def total_logprob(learner: Learner, conversation: Conversation) -> float:
    return float(learner.response_logprobs([conversation])[0].sum())


def test_response_logprobs_match_a_plain_forward_and_ignore_micro_batching(
    test_model_path: str, conversations: list[Conversation]
) -> None:
    learner = make_learner(test_model_path)
    pair = conversations[:2]
    assert pair[0].n_tokens != pair[1].n_tokens  # so one row is padded
    together = learner.response_logprobs(pair, micro_batch_tokens=10_000)
    alone = learner.response_logprobs(pair, micro_batch_tokens=1)
    for conversation, batched, single in zip(pair, together, alone, strict=True):
        expected = plain_logprobs(learner.model, conversation)
        assert batched.dtype == torch.float32
        assert batched.shape == (len(conversation.response_ids),)
        torch.testing.assert_close(batched, expected, rtol=0.0, atol=LOGPROB_ATOL)
        torch.testing.assert_close(single, expected, rtol=0.0, atol=LOGPROB_ATOL)


def test_log_probabilities_are_those_of_the_sampling_temperature(
    test_model_path: str, conversations: list[Conversation]
) -> None:
    learner = make_learner(test_model_path, temperature=0.7)
    (tempered,) = learner.response_logprobs(conversations[:1])
    expected = plain_logprobs(learner.model, conversations[0], temperature=0.7)
    torch.testing.assert_close(tempered, expected, rtol=0.0, atol=LOGPROB_ATOL)
    assert not torch.allclose(tempered, plain_logprobs(learner.model, conversations[0]))


def test_the_ratio_starts_at_one_and_then_moves(
    test_model_path: str, conversations: list[Conversation]
) -> None:
    algorithm = TrainingAlgorithmConfig.preset("memagent")  # with a KL loss to the reference
    learner = make_learner(test_model_path, mini_batch_conversations=2, algorithm=algorithm)
    metrics = learner.step(conversations, [1.0, -1.0, 0.5, -0.5])
    first, second = metrics.mini_batches
    assert first.clip_fraction == 0.0
    assert abs(first.approx_kl) < 1e-6
    assert first.kl is not None and abs(first.kl) < 1e-6  # the policy is still the reference
    # The first step moved the weights the second mini-batch sees.
    assert abs(second.approx_kl) > 1e-6 and second.kl is not None and second.kl > 0
    assert metrics.optimizer_steps == 2 and learner.global_step == 2
    assert metrics.n_tokens == sum(len(c.response_ids) for c in conversations)
    assert metrics.tokens_per_s > 0


def test_positive_advantage_raises_and_negative_lowers_the_reply(
    test_model_path: str, conversations: list[Conversation]
) -> None:
    learner = make_learner(test_model_path, mini_batch_conversations=2, epochs_per_batch=2)
    rewarded, punished = conversations[0], conversations[2]
    before = total_logprob(learner, rewarded), total_logprob(learner, punished)
    for _ in range(2):
        learner.step([rewarded, punished], [1.0, -1.0])
    after = total_logprob(learner, rewarded), total_logprob(learner, punished)
    assert after[0] > before[0] + 0.1, (before, after)
    assert after[1] < before[1] - 0.1, (before, after)


def test_a_resumed_checkpoint_continues_like_an_uninterrupted_run(
    test_model_path: str, conversations: list[Conversation], tmp_path: Path
) -> None:
    config = LearnerConfig(
        model=test_model_path,
        learning_rate=1e-4,
        warmup_steps=3,
        mini_batch_conversations=2,
        seed=7,
    )
    first_batch, second_batch = conversations[:3], conversations[1:]
    running = Learner(config)
    running.step(first_batch, [1.0, -1.0, 0.5])
    checkpoint = running.save_checkpoint(tmp_path / "checkpoint")
    resumed = Learner.resume(checkpoint, config)

    assert resumed.global_step == running.global_step == 2 and resumed.updates == 1
    for (name, kept), restored in zip(
        running.model.state_dict().items(), resumed.model.state_dict().values(), strict=True
    ):
        assert torch.equal(kept, restored), name
    kept_state, restored_state = running.optimizer.state_dict(), resumed.optimizer.state_dict()
    assert kept_state["param_groups"] == restored_state["param_groups"]
    for key, kept in kept_state["state"].items():
        for field, value in kept.items():
            assert torch.equal(value, restored_state["state"][key][field]), (key, field)
    assert running.scheduler.state_dict() == resumed.scheduler.state_dict()

    uninterrupted = running.step(second_batch, [-1.0, 1.0, 0.25])
    continued = resumed.step(second_batch, [-1.0, 1.0, 0.25])
    assert uninterrupted.optimizer_steps == continued.optimizer_steps == 2
    for kept, restored in zip(uninterrupted.mini_batches, continued.mini_batches, strict=True):
        assert abs(kept.loss - restored.loss) <= 1e-6
        assert kept.n_conversations == restored.n_conversations  # the same shuffle
    assert uninterrupted.learning_rate == continued.learning_rate

    assert AutoModelForCausalLM.from_pretrained(checkpoint).config.vocab_size == 49152
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    assert tokenizer.decode(conversations[0].response_ids) == TEXTS[0][1]
    assert (checkpoint / "chat_template.jinja").is_file()

    exported = running.export_weights(tmp_path / "export")
    assert (exported / "model.safetensors").is_file() and (exported / "tokenizer.json").is_file()
    assert not (exported / STATE_FILE).exists()


def test_a_failed_save_leaves_the_previous_folder(tmp_path: Path) -> None:
    target = tmp_path / "checkpoint"
    write_atomically(target, lambda folder: (folder / "weights").write_text("one"))

    def interrupted(folder: Path) -> None:
        (folder / "weights").write_text("two")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_atomically(target, interrupted)
    assert (target / "weights").read_text() == "one"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["checkpoint"]

    write_atomically(target, lambda folder: (folder / "weights").write_text("three"))
    assert (target / "weights").read_text() == "three"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["checkpoint"]


def test_metrics_are_appended_one_json_line_per_step(tmp_path: Path) -> None:
    log = tmp_path / "logs" / "metrics.jsonl"
    append_metrics(log, 1, {"loss": 0.5, "kl": None})
    append_metrics(log, 2, {"loss": 0.25, "kl": 0.01})
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert rows == [{"step": 1, "loss": 0.5, "kl": None}, {"step": 2, "loss": 0.25, "kl": 0.01}]


def test_conversations_check_their_lengths() -> None:
    with pytest.raises(ValueError, match="prompt token"):
        Conversation(sample_index=0, prompt_ids=(), response_ids=(1,))
    with pytest.raises(ValueError, match="rollout_logprobs"):
        Conversation(sample_index=0, prompt_ids=(1,), response_ids=(2, 3), rollout_logprobs=(0.0,))
