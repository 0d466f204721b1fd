"""LoRA adapters as peft saves them, checked and merged with plain torch and safetensors (no peft):
W += (lora_alpha / r) B A for each adapted linear weight, computed in float32 and stored in W's
dtype. What the merge cannot reproduce (rsLoRA, DoRA, saved modules, biases, per-module ranks) is
refused with the reason. `connectors.engines.models` ships adapted models with it.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
# The repository keeps adapters small: a rank-8 adapter of a 0.5B model is about 18 MB in float32.
MAX_ADAPTER_BYTES = 30_000_000
_PEFT_PREFIX = "base_model.model."
_LORA_SUFFIXES = (".lora_A.weight", ".lora_B.weight")


class AdapterError(RuntimeError):
    """An adapter that cannot be used; the message says why."""


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as data:
        while block := data.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


@dataclass(frozen=True)
class LoraSettings:
    r: int
    lora_alpha: float
    target_modules: tuple[str, ...] | str  # names, or peft's pattern / "all-linear"

    @property
    def scale(self) -> float:
        return self.lora_alpha / self.r


# adapter_config.json settings that change what the adapter computes beyond W + alpha/r B A:
# refused, with the reason, when they are set.
_UNSUPPORTED_LORA = {
    "use_rslora": "rank-stabilised LoRA (use_rslora) scales by alpha/sqrt(r)",
    "use_dora": "DoRA (use_dora) rescales the merged weight by a magnitude vector",
    "modules_to_save": "modules_to_save replaces whole modules",
    "lora_bias": "lora_bias adds a bias to lora_B",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D weights) stores the weight transposed",
    "rank_pattern": "rank_pattern gives modules their own ranks",
    "alpha_pattern": "alpha_pattern gives modules their own alphas",
    "layer_replication": "layer_replication changes the layers",
    "target_parameters": "target_parameters adapts parameters, not linear layers",
    "trainable_token_indices": "trainable_token_indices changes embeddings",
    "use_qalora": "QA-LoRA (use_qalora) pools its input",
    "alora_invocation_tokens": "aLoRA (alora_invocation_tokens) activates on tokens",
}


def lora_settings(config: dict[str, Any], base: str | None = None) -> LoraSettings:
    """r, lora_alpha and the target modules of a peft `adapter_config.json`, or a AdapterError
    naming what this merge does not support (it adds alpha/r B A to each adapted linear
    weight, nothing else). With `base`, the config's base model must be that packaged model
    (its name, or a folder of that name)."""
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"not a LoRA adapter: peft_type {config.get('peft_type')!r}")
    for key, reason in _UNSUPPORTED_LORA.items():
        if config.get(key):
            raise AdapterError(f"unsupported adapter setting {key}={config[key]!r}: {reason}")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"unsupported adapter setting bias={config['bias']!r}: only 'none'")
    named = config.get("base_model_name_or_path")
    if base is not None and named and named != base and Path(named).name != base:
        raise AdapterError(
            f"the adapter was trained on {named!r}, not on the packaged model {base!r}"
        )
    try:
        r, alpha = int(config["r"]), float(config["lora_alpha"])
    except (KeyError, TypeError, ValueError) as error:
        raise AdapterError(f"adapter config without a valid r and lora_alpha: {error!r}") from error
    if r < 1 or alpha <= 0:
        raise AdapterError(f"adapter config with r={r}, lora_alpha={alpha}")
    targets = config.get("target_modules")
    if not targets:
        raise AdapterError("adapter config names no target_modules")
    return LoraSettings(
        r=r,
        lora_alpha=alpha,
        target_modules=targets if isinstance(targets, str) else tuple(sorted(targets)),
    )


def lora_pairs(keys: Sequence[str], settings: LoraSettings) -> dict[str, tuple[str, str]]:
    """The base weight each lora_A/lora_B pair of an adapter's tensor names changes, as
    {base weight name: (A name, B name)}: peft's `base_model.model.<module>.lora_A.weight`
    changes `<module>.weight`. Any other tensor (embeddings, DoRA magnitudes, saved modules,
    biases) or an unpaired half is a AdapterError."""
    halves: dict[str, dict[str, str]] = {}
    for key in keys:
        suffix = next((end for end in _LORA_SUFFIXES if key.endswith(end)), None)
        if suffix is None or not key.startswith(_PEFT_PREFIX):
            raise AdapterError(f"unsupported adapter tensor {key!r}: only lora_A/lora_B of linears")
        module = key[len(_PEFT_PREFIX) : -len(suffix)]
        halves.setdefault(module, {})[suffix] = key
    pairs = {}
    for module, found in sorted(halves.items()):
        if len(found) != 2:
            raise AdapterError(f"adapter module {module!r} lacks its lora_A or lora_B")
        if isinstance(settings.target_modules, tuple) and not any(
            module == target or module.endswith(f".{target}")  # peft's match of a name
            for target in settings.target_modules
        ):
            raise AdapterError(f"adapter module {module!r} is not among its target_modules")
        pairs[f"{module}.weight"] = (found[_LORA_SUFFIXES[0]], found[_LORA_SUFFIXES[1]])
    if not pairs:
        raise AdapterError("the adapter holds no lora_A/lora_B tensors")
    return pairs


def check_adapter(folder: Path, *, base: str | None, sha256: str | None = None) -> LoraSettings:
    """The settings of the adapter in `folder` after checking its files: present, at most
    MAX_ADAPTER_BYTES, the weights' sha256 (when given), a config `lora_settings` takes and
    tensors `lora_pairs` takes."""
    from safetensors import safe_open

    config_path, weights = folder / ADAPTER_CONFIG_FILE, folder / ADAPTER_WEIGHTS_FILE
    for path in (config_path, weights):
        if not path.is_file():
            raise AdapterError(f"no adapter at {folder}: {path.name} is missing")
    size = weights.stat().st_size
    if size > MAX_ADAPTER_BYTES:
        raise AdapterError(
            f"the adapter in {folder} is {size / 1e6:.1f} MB, over the "
            f"{MAX_ADAPTER_BYTES / 1e6:.0f} MB kept in the repository: train a lower rank or "
            "store it in bfloat16"
        )
    if sha256 is not None and (got := file_sha256(weights)) != sha256:
        raise AdapterError(
            f"sha256 mismatch for {weights}: got {got}, expected {sha256}; "
            "the adapter changed since it was packaged, do not use it"
        )
    try:
        config = json.loads(config_path.read_text())
    except ValueError as error:
        raise AdapterError(f"{config_path} is not JSON: {error}") from error
    settings = lora_settings(config, base)
    with safe_open(str(weights), framework="pt") as tensors:
        lora_pairs(list(tensors.keys()), settings)
    return settings


def merge_lora(base_dir: Path, adapter_dir: Path, out: Path, settings: LoraSettings) -> None:
    """Writes into the new folder `out` the base model folder's files with its safetensors
    weights merged with the adapter: W += (lora_alpha / r) B A for each adapted linear, computed
    in float32 and stored in W's dtype. Plain torch and safetensors: no peft."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    shards = sorted(base_dir.glob("*.safetensors"))
    if not shards:
        raise AdapterError(f"{base_dir} holds no safetensors weights to merge the adapter into")
    adapter = load_file(str(adapter_dir / ADAPTER_WEIGHTS_FILE))
    pending = lora_pairs(list(adapter), settings)
    out.mkdir(parents=True)
    for item in base_dir.iterdir():
        if item.is_file() and item.suffix != ".safetensors":
            shutil.copy2(item, out / item.name)
    for shard in shards:
        with safe_open(str(shard), framework="pt") as handle:
            metadata = handle.metadata() or {"format": "pt"}
        weights = load_file(str(shard))
        for name in [name for name in pending if name in weights]:
            a_name, b_name = pending.pop(name)
            weight, a, b = weights[name], adapter[a_name].float(), adapter[b_name].float()
            if (
                a.shape[0] != settings.r
                or b.shape[1] != settings.r
                or (weight.shape != (b.shape[0], a.shape[1]))
            ):
                raise AdapterError(
                    f"adapter shapes for {name} do not fit: weight {tuple(weight.shape)}, "
                    f"lora_A {tuple(a.shape)}, lora_B {tuple(b.shape)}, r={settings.r}"
                )
            with torch.no_grad():
                merged = weight.float() + settings.scale * (b @ a)
            weights[name] = merged.to(weight.dtype).contiguous()
        save_file(weights, str(out / shard.name), metadata=metadata)
        del weights
    if pending:
        raise AdapterError(
            f"the adapter changes weights the base model in {base_dir} does not hold "
            f"(tied or renamed?): {', '.join(sorted(pending)[:3])}"
        )
