"""pipeline.training.learner with LoRA (peft) on the real SmolLM2-135M in fp32: a step moves only
the adapter, raises the log-probability of rewarded replies, resumes from its checkpoint, and
exports merged weights that load as a plain transformers model (what the rollout engine reads).
About 3 minutes on two busy cores: three model loads and a 540 MB merged save with fsync."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from pipeline.training.learner import ADAPTER_DIR, Conversation, Learner, LearnerConfig

PROMPT = "Remember this for later: the access code of the blue door is 4417."
REPLY = " The code is 4417."


@pytest.fixture(scope="module")
def conversation(tokenizer) -> Conversation:  # type: ignore[no-untyped-def]
    return Conversation(
        sample_index=0,
        prompt_ids=tuple(tokenizer(PROMPT)["input_ids"]),
        response_ids=tuple(tokenizer(REPLY)["input_ids"]),
    )


def lora_config(model: str) -> LearnerConfig:
    return LearnerConfig(
        model=model, lora=True, lora_rank=4, learning_rate=1e-3, warmup_steps=0, shuffle=False
    )


def total_logprob(learner: Learner, conversation: Conversation) -> float:
    return float(learner.response_logprobs([conversation])[0].sum())


def merged_logprobs(folder: Path, conversation: Conversation) -> torch.Tensor:
    """The reply's log-probabilities under the folder's weights, loaded as transformers (and the
    engine) would: a plain causal LM, no peft."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor([conversation.prompt_ids + conversation.response_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    start = len(conversation.prompt_ids) - 1
    predicting = torch.log_softmax(logits, dim=-1)[start:-1]
    return predicting.gather(-1, ids[0, start + 1 :].unsqueeze(-1)).squeeze(-1)


def test_lora_trains_only_the_adapter_exports_merged_weights_and_resumes(
    test_model_path: str, conversation: Conversation, tmp_path: Path
) -> None:
    config = lora_config(test_model_path)
    learner = Learner(config)
    trainable = {name for name, p in learner.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in name for name in trainable)
    before = {name: p.detach().clone() for name, p in learner.model.named_parameters()}
    start = total_logprob(learner, conversation)

    losses = [learner.step([conversation], [1.0]).loss for _ in range(2)]

    changed = {
        name
        for name, p in learner.model.named_parameters()
        if not torch.equal(p.detach(), before[name])
    }
    assert changed and changed <= trainable
    # One mini-batch per step, so each step's loss is -A at ratio 1; the rewarded reply's
    # log-probability is what the updates raise.
    assert all(loss == pytest.approx(-1.0, abs=1e-5) for loss in losses)
    assert total_logprob(learner, conversation) > start

    # The checkpoint (and export_weights, the same writer) holds the merged weights at the top,
    # which the rollout engine reloads, and the adapter beside them, which resume reads.
    checkpoint = learner.save_checkpoint(tmp_path / "checkpoint")
    assert list(checkpoint.glob("*.safetensors"))
    assert (checkpoint / ADAPTER_DIR / "adapter_config.json").is_file()
    current = learner.response_logprobs([conversation])[0]
    torch.testing.assert_close(
        merged_logprobs(checkpoint, conversation), current, rtol=0.0, atol=1e-4
    )

    resumed = Learner.resume(checkpoint, config)
    assert (resumed.global_step, resumed.updates) == (learner.global_step, learner.updates)
    assert {n for n, p in resumed.model.named_parameters() if p.requires_grad} == trainable
    torch.testing.assert_close(
        resumed.response_logprobs([conversation])[0], current, rtol=0.0, atol=1e-6
    )
    # The resumed optimiser state gives the step the original would take.
    learner.step([conversation], [1.0])
    resumed.step([conversation], [1.0])
    torch.testing.assert_close(
        resumed.response_logprobs([conversation])[0],
        learner.response_logprobs([conversation])[0],
        rtol=0.0,
        atol=1e-5,
    )
