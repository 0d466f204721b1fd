"""The learner on Ray Train (pipeline.training.ray_learner) against the in-process learner, on
a tiny Llama with SmolLM2's vocabulary and tokenizer and a fixed rollout batch (no engine): one
CPU worker of a local Ray session (2 CPUs) takes the batch's optimiser steps through the
trainer's own `learn_from_batch`, and leaves the same weights, the checkpoint and the metrics
line where the in-process run does; a second step resumes from that checkpoint. Then two
workers, for DDP. The learner on the real SmolLM2 is tests/test_training_learner.py's and
test_training_run.py's; here the model's size would only add minutes."""

from __future__ import annotations

import gc
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pipeline.training.config import TrainConfig
from pipeline.training.learner import STATE_FILE, Conversation, Learner
from pipeline.training.rollout import ChainRollout
from pipeline.training.trainer import (
    CHECKPOINT_DIR,
    METRICS_FILE,
    RAY_TRAIN_DIR,
    RolloutBatch,
    learn_from_batch,
    open_learner,
)

# Four chains of two samples, each a memory update and a final answer; rewards 1/0 in each group.
CHAINS = [
    (0, 1.0, "Remember this: the access code of the blue door is 4417.", " code 4417", " 4417"),
    (0, 0.0, "Remember this: the access code of the blue door is 4417.", " a blue door", " 12"),
    (1, 0.0, "Keep the fact. The ship leaves at dawn from the north quay.", " ships", " noon"),
    (1, 1.0, "Keep the fact. The ship leaves at dawn from the north quay.", " dawn", " dawn"),
]
LEARNING_RATE = 1e-4


@pytest.fixture
def ray_session() -> Iterator[None]:
    """A local Ray session per test, so that one test's failed run cannot hold the CPUs the
    next one's workers wait for."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def batch(tokenizer) -> RolloutBatch:  # type: ignore[no-untyped-def]
    def ids(text: str) -> tuple[int, ...]:
        return tuple(tokenizer(text, add_special_tokens=False)["input_ids"])

    rollouts = []
    for group, reward, document, memory, answer in CHAINS:
        update = Conversation(0, ids(f"Memory: (none). Text: {document} New memory:"), ids(memory))
        final = Conversation(
            0, ids(f"Memory:{memory}. Question: the code or time? Answer:"), ids(answer)
        )
        rollouts.append(
            ChainRollout(
                group=group, conversations=(update, final), response=answer, answer=None,
                reward=reward, memory_hit_budget=(False,),
            )
        )  # fmt: skip
    return RolloutBatch(
        rollouts=rollouts, draws=1, groups_drawn=2, groups_kept=2, reward_mean=0.5, seconds=0.0
    )


def train_config(model: str, output: Path, **overrides: object) -> TrainConfig:
    # 3 conversations a mini-batch, so a batch of 8 takes 3 optimiser steps and the later ones
    # see a ratio away from 1. dapo has no KL term, so no reference model: SmolLM2 with its
    # AdamW state is 2 GB a learner, on a machine whose memory other work shares.
    settings: dict[str, object] = {
        "output": output, "model": model, "preset": "dapo", "learning_rate": LEARNING_RATE,
        "warmup_steps": 0, "mini_batch_conversations": 3, "seed": 5,
    }  # fmt: skip
    return TrainConfig.model_validate({**settings, **overrides})


def one_step(config: TrainConfig, step: int, batch: RolloutBatch) -> dict[str, object]:
    learner = open_learner(config, config.learner_config(config.model))
    try:
        assert learner.updates == step - 1
        return learn_from_batch(config, learner, step, batch, log=lambda message: None)
    finally:
        learner.close()
        del learner
        gc.collect()  # the in-process learner's weights and optimiser state, before the next


def largest_difference(first: Path, second: Path) -> float:
    """The largest |difference| of a weight between two model folders' safetensors."""
    one, other = load_file(first / "model.safetensors"), load_file(second / "model.safetensors")
    shared = one.keys() & other.keys()
    assert len(shared) >= len(one) - 1  # a tied lm_head may be left out of one of them
    return max(float((one[name] - other[name]).abs().max()) for name in shared)


def batch_logprobs(config: TrainConfig, batch: RolloutBatch) -> torch.Tensor:
    """The batch's response log-probabilities under the run's checkpoint, by the learner."""
    learner = Learner.resume(config.output / CHECKPOINT_DIR, config.learner_config(config.model))
    conversations = [c for rollout in batch.rollouts for c in rollout.conversations]
    logprobs = torch.cat(learner.response_logprobs(conversations))
    del learner
    gc.collect()
    return logprobs


def metrics_lines(output: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in (output / METRICS_FILE).read_text().splitlines()]


def test_a_ray_train_worker_steps_like_the_in_process_learner(
    ray_session: None, tiny_model: str, batch: RolloutBatch, tmp_path: Path
) -> None:
    local = train_config(tiny_model, tmp_path / "in-process")
    remote = train_config(
        tiny_model, tmp_path / "ray", learner="ray-train", learner_cpus_per_worker=2
    )
    expected = one_step(local, 1, batch)
    reported = one_step(remote, 1, batch)

    checkpoint = remote.output / CHECKPOINT_DIR
    assert (checkpoint / STATE_FILE).is_file() and (checkpoint / "tokenizer.json").is_file()
    assert json.loads((checkpoint / "learner.json").read_text())["global_step"] == 3
    # The reported checkpoint was copied out of Ray Train's storage, then removed there.
    assert not any((remote.output / RAY_TRAIN_DIR).glob("update-*"))

    (line,) = metrics_lines(remote.output)
    assert line == reported and set(line) == set(expected)
    assert line["learner_optimizer_steps"] == expected["learner_optimizer_steps"] == 3
    assert line["learner_n_tokens"] == expected["learner_n_tokens"]
    assert line["learner_loss"] == pytest.approx(expected["learner_loss"], abs=1e-5)
    assert line["learner_clip_fraction"] == expected["learner_clip_fraction"]

    # Same code, start, batch and seed. Adam moves a weight by about lr a step where |g| >> eps
    # (1e-8), so a different start or batch leaves many weights about lr apart; a rounding
    # difference dg in the gradient (another thread count, another order of summation) moves
    # a weight by about lr·dg/|g|, or lr·dg/eps where |g| is below eps: far less than lr. A
    # tenth of one step separates the two; the weights must also have moved by steps of lr.
    largest_gap = largest_difference(local.output / CHECKPOINT_DIR, checkpoint)
    largest_move = largest_difference(Path(tiny_model), checkpoint)
    print(f"one worker: largest gap {largest_gap:.3g}, largest move {largest_move:.3g}")
    assert largest_gap <= LEARNING_RATE / 10, largest_gap
    assert largest_move >= LEARNING_RATE / 2, largest_move
    torch.testing.assert_close(
        batch_logprobs(remote, batch), batch_logprobs(local, batch), rtol=0.0, atol=1e-4
    )

    # The next step resumes the worker from the checkpoint the driver wrote.
    resumed = remote.model_copy(update={"resume": True})
    second = one_step(resumed, 2, batch)
    assert second["learner_optimizer_steps"] == 3
    assert json.loads((checkpoint / "learner.json").read_text())["global_step"] == 6
    assert [row["step"] for row in metrics_lines(remote.output)] == [1, 2]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory, test_model_path: str) -> str:
    """A randomly initialised two-layer Llama on SmolLM2's vocabulary, with its tokenizer: small
    enough for two learner workers and an in-process learner on two cores."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True,
    )  # fmt: skip
    folder = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).save_pretrained(folder)
    for tokenizer_file in Path(test_model_path).glob("tokenizer*"):
        shutil.copy(tokenizer_file, folder)
    return str(folder)


def test_two_workers_average_their_gradients_into_the_one_process_step(
    ray_session: None, tiny_model: str, batch: RolloutBatch, tmp_path: Path
) -> None:
    # Two workers each take every other conversation of a mini-batch; DDP's average of their
    # gradients, scaled by the number of workers, is the one-process gradient. 3 conversations
    # a mini-batch of 8 split 2/1 between the workers; 7 leave a last mini-batch of 1, which
    # gives worker 1 no conversation of its own (it runs one at weight 0).
    for mini_batch in (3, 7):
        # memagent: the KL to the reference is on, and summed over the workers too.
        local = train_config(tiny_model, tmp_path / f"in-process-{mini_batch}",
                             mini_batch_conversations=mini_batch, preset="memagent")  # fmt: skip
        remote = local.model_copy(
            update={"output": tmp_path / f"ray-{mini_batch}", "learner": "ray-train",
                    "learner_workers": 2}
        )  # fmt: skip
        expected, reported = one_step(local, 1, batch), one_step(remote, 1, batch)
        assert reported["learner_optimizer_steps"] == expected["learner_optimizer_steps"]
        assert reported["learner_n_tokens"] == expected["learner_n_tokens"]
        assert reported["learner_loss"] == pytest.approx(expected["learner_loss"], abs=1e-6)
        assert reported["learner_kl"] == pytest.approx(expected["learner_kl"], abs=1e-6)
        assert reported["learner_clip_fraction"] == expected["learner_clip_fraction"]
        gap = largest_difference(local.output / CHECKPOINT_DIR, remote.output / CHECKPOINT_DIR)
        print(f"two workers, mini-batch {mini_batch}: largest gap {gap:.3g}")
        assert gap <= LEARNING_RATE / 10, (mini_batch, gap)
        torch.testing.assert_close(
            batch_logprobs(remote, batch), batch_logprobs(local, batch), rtol=0.0, atol=1e-4
        )
