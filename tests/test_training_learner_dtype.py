"""The learner's precision setting on a tiny Llama built from a config (no download, no
tokenizer): bfloat16 autocast over float32 master weights, against the float32 learner."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from connectors.engines.hardware import Hardware
from pipeline.cli.flags import UserError, model_from_flags
from pipeline.cli.main import build_parser
from pipeline.training import config as training_config
from pipeline.training.config import TrainConfig
from pipeline.training.learner import SUMMARY_FILE, Conversation, Learner, LearnerConfig

VOCAB = 96


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
    )  # fmt: skip
    folder = tmp_path_factory.mktemp("tiny-llama-dtype")
    LlamaForCausalLM(config).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def conversations() -> list[Conversation]:
    generator = torch.Generator().manual_seed(1)

    def ids(n: int) -> tuple[int, ...]:
        return tuple(torch.randint(1, VOCAB, (n,), generator=generator).tolist())

    return [
        Conversation(sample_index=index // 2, prompt_ids=ids(10 + 3 * index), response_ids=ids(6))
        for index in range(6)
    ]


def learner(model: str, dtype: str, **overrides: object) -> Learner:
    settings = {
        "model": model, "learning_rate": 1e-3, "warmup_steps": 0, "dtype": dtype,
        "mini_batch_conversations": 3, "shuffle": False,
    }  # fmt: skip
    return Learner(LearnerConfig.model_validate({**settings, **overrides}))


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([parameter.detach().flatten() for parameter in model.parameters()])


ADVANTAGES = [1.0, 1.0, -1.0, -1.0, 0.5, -0.5]


def test_float32_is_the_default_everywhere(tmp_path: Path) -> None:
    assert LearnerConfig(model="unused").dtype == "float32"
    assert TrainConfig(output=tmp_path).learner_config("base").dtype == "float32"


def test_bfloat16_autocasts_over_float32_master_weights(
    tiny_llama: str, conversations: list[Conversation]
) -> None:
    full, mixed = learner(tiny_llama, "float32"), learner(tiny_llama, "bfloat16")
    assert {p.dtype for p in mixed.model.parameters()} == {torch.float32}
    exact = full.response_logprobs(conversations)
    autocast = mixed.response_logprobs(conversations)
    gaps = torch.cat([(a - b).abs() for a, b in zip(exact, autocast, strict=True)])
    assert all(lp.dtype == torch.float32 for lp in autocast)
    # bfloat16 matmuls moved them (autocast is on), by little (a mask or position error moves
    # them by nats): 3e-4 nats a token measured on this model.
    assert 0 < float(gaps.mean()) < 1e-2

    before = flat(mixed.model)
    metrics = mixed.step(conversations, ADVANTAGES)
    reference = full.step(conversations, ADVANTAGES)
    assert metrics.dtype == "bfloat16" and reference.dtype == "float32"
    assert metrics.to_dict()["dtype"] == "bfloat16"
    # The old log-probabilities are recomputed under the same autocast: the ratio starts at
    # exactly 1, and moves after the first optimiser step.
    first, second = metrics.mini_batches
    assert first.approx_kl == 0.0 and first.clip_fraction == 0.0
    assert second.approx_kl != 0.0
    assert {p.dtype for p in mixed.model.parameters()} == {torch.float32}
    assert {v.dtype for s in mixed.optimizer.state.values() for v in s.values()} <= {torch.float32}
    # The same update as the float32 learner's, up to bfloat16 rounding of the gradients
    # (cosine 0.998 measured).
    moved, expected = flat(mixed.model) - before, flat(full.model) - before
    assert float(moved.abs().max()) > 0
    cosine = torch.nn.functional.cosine_similarity(moved, expected, dim=0)
    assert float(cosine) > 0.95


def test_the_dtype_is_a_flag_and_recorded_in_the_checkpoint(
    tiny_llama: str, conversations: list[Conversation], tmp_path: Path
) -> None:
    args = build_parser().parse_args(
        ["train", "--output", str(tmp_path), "--learner-dtype", "bfloat16"]
    )
    config = model_from_flags(TrainConfig, args)
    assert config.learner_dtype == "bfloat16"
    assert config.learner_config(tiny_llama).dtype == "bfloat16"
    assert json.loads(config.model_dump_json())["learner_dtype"] == "bfloat16"  # train.json
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--output", str(tmp_path), "--learner-dtype", "fp8"])
    verl = build_parser().parse_args(
        ["train", "--output", str(tmp_path), "--backend", "verl", "--learner-dtype", "bfloat16"]
    )
    with pytest.raises(UserError, match="learner-dtype"):  # verl's actor has its own precision
        verl.handler(verl)

    mixed = learner(tiny_llama, "bfloat16")
    mixed.step(conversations, ADVANTAGES)
    checkpoint = mixed.save_checkpoint(tmp_path / "weights")
    summary = json.loads((checkpoint / SUMMARY_FILE).read_text())
    assert summary["config"]["dtype"] == "bfloat16"
    resumed = Learner.resume(checkpoint, mixed.config)
    assert {p.dtype for p in resumed.model.parameters()} == {torch.float32}
    assert torch.equal(flat(resumed.model), flat(mixed.model))


@pytest.mark.parametrize(
    ("flags", "expected"),
    [(frozenset({"avx2", "avx512_bf16"}), "bfloat16"), (frozenset({"avx2"}), "float32")],
)
def test_auto_takes_bfloat16_only_where_the_cpu_runs_it_natively(
    flags: frozenset[str], expected: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    cpu = Hardware(cpu_model="test CPU", cores=2, cpu_flags=flags)
    monkeypatch.setattr(training_config, "detect", lambda: cpu)
    assert training_config.resolve_learner_dtype("auto") == expected
    assert training_config.resolve_learner_dtype("float32") == "float32"
    config = TrainConfig(output=Path("unused"), learner_dtype="auto")
    assert config.learner_config("unused-model").dtype == expected
