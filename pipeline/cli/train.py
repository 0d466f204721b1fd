"""`memstream train`: Multi-Conv DAPO on a packaged model, on the CPU (pipeline.training).

Its flags are generated from `TrainConfig`, one per field, so the command, the Python API and
the checkpoint's `train.json` name every setting alike. `--backend verl` trains nothing here: it
writes the same run as verl's inputs for a GPU cluster (pipeline.training.verl_export).
"""

from __future__ import annotations

import argparse
from pathlib import PurePosixPath
from typing import Any

from pipeline.cli.flags import UserError, add_model_flags, model_from_flags, positive_int
from pipeline.training.config import TrainConfig


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "train",
        help="teach a model to keep facts in its memory by RL (Multi-Conv DAPO)",
        description="Train a memory agent: sampled memory chains, the final answer's reward "
        "broadcast to every update, DAPO's clipped token-mean loss. Writes a checkpoint that "
        "`--model` accepts, and one line of metrics a step; --resume continues a run.",
    )
    add_model_flags(parser, TrainConfig)
    verl = parser.add_argument_group("verl backend")
    verl.add_argument(
        "--backend",
        choices=["native", "verl"],
        default="native",
        help="native: train here; verl: write the run's dataset (Parquet), reward function, "
        "agent loop and trainer config for verl on a GPU cluster into --output, and train "
        "nothing (default: %(default)s)",
    )
    verl.add_argument(
        "--verl-cluster-dir",
        type=PurePosixPath,
        default=None,
        help="where the cluster sees the --output folder: the exported files name each other "
        "by it (default: /data/memstream-verl, the volume of infra/k8s/rayjob-verl.yaml)",
    )
    verl.add_argument(
        "--verl-nodes", type=positive_int, default=None, help="GPU nodes of the run (default: 1)"
    )
    verl.add_argument(
        "--verl-gpus-per-node", type=positive_int, default=None, help="GPUs a node (default: 8)"
    )
    parser.set_defaults(handler=run_train_command)


# Settings of where and how this machine trains, which a verl run takes from its own config.
NATIVE_ONLY = (
    "resume", "learner", "learner_workers", "learner_gpus_per_worker", "learner_cpus_per_worker",
    "learner_storage", "rollout_actors", "rollout_cpus_per_actor", "rollout_gpus_per_actor",
    "ray_address", "kv_cache_gib", "max_model_len", "micro_batch_tokens", "learner_dtype",
    "heldout_every", "heldout_samples",
)  # fmt: skip
VERL_ONLY = ("verl_cluster_dir", "verl_nodes", "verl_gpus_per_node")


def run_train_command(args: argparse.Namespace) -> int:
    config = model_from_flags(TrainConfig, args)
    check_paths(config)
    if args.backend == "verl":
        return export_for_verl(config, args)
    given = [name for name in VERL_ONLY if getattr(args, name) is not None]
    if given:
        raise UserError(f"{flag_names(given)}: only with --backend verl")
    from pipeline.training.trainer import run_training

    run_training(config)
    return 0


def export_for_verl(config: TrainConfig, args: argparse.Namespace) -> int:
    from pipeline.training.verl_export import CONFIG_NAME, VerlCluster, export_verl

    given = [name for name in NATIVE_ONLY if hasattr(args, name)]
    if given:
        raise UserError(f"{flag_names(given)}: not used by --backend verl (verl's config says it)")
    defaults = VerlCluster()
    cluster = VerlCluster(
        directory=args.verl_cluster_dir or defaults.directory,
        nodes=args.verl_nodes or defaults.nodes,
        gpus_per_node=args.verl_gpus_per_node or defaults.gpus_per_node,
    )
    for path in export_verl(config, cluster):
        print(path)
    print(
        f"verl reads these files at {cluster.directory}: put the folder there on the volume "
        "infra/k8s/rayjob-verl.yaml mounts and `kubectl apply -f infra/k8s/rayjob-verl.yaml`, or "
        f"on a Ray cluster with verl: python3 -m verl.trainer.main_ppo "
        f"--config-path={cluster.directory} --config-name={CONFIG_NAME}"
    )
    return 0


def flag_names(names: list[str]) -> str:
    return ", ".join("--" + name.replace("_", "-") for name in names)


def check_paths(config: TrainConfig) -> None:
    """The files a run reads and the folder it writes, checked before a model is loaded."""
    if config.answers is not None:
        if not config.answers.is_file():
            raise UserError(f"--answers {config.answers}: no such file")
        from pipeline.training.tasks import read_jsonl

        read_jsonl(config.answers)  # each row's fields, before any model loads
    if config.output.exists() and not config.output.is_dir():
        raise UserError(f"--output {config.output} is a file: name a folder")
