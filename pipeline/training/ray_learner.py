"""The learner on Ray Train: each rollout batch's optimiser steps run as a TorchTrainer.

`learner_worker` is the Ray Train worker function. It runs the in-process learner's own code
(`Learner.learn`, pipeline.training.learner) on one worker of a data-parallel group:

1. the driver (`RayTrainLearner.learn`) puts the batch's conversations and advantages in Ray's
   object store and starts a `TorchTrainer` of `workers` workers, passing each the object ref
   and the folder of the current checkpoint (none before the first step);
2. each worker loads the learner from that checkpoint onto its device (`ray.train.torch.
   get_device`), hands its policy to `prepare_model` (DDP with more than one worker, which
   averages the gradients; `Learner.distribute`), and takes the batch's optimiser steps;
3. worker 0 writes the checkpoint and reports it with the metrics (`ray.train.report`); Ray
   Train persists it under its `storage_path`, and the driver copies it atomically to the
   folder the in-process learner writes (`<output>/weights`), where the rollout engine reloads
   it and `--resume` reads it. The run's folder in the storage is then removed.

A TorchTrainer is started per rollout batch, so each batch pays the workers' start and a model
load (about 15 s for SmolLM2-135M on two CPU cores); rollouts and learning alternate anyway.
Workers read the start checkpoint from the driver's output folder, so on a multi-node cluster
`--output` (and the storage) must be a folder every node mounts.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from pipeline.training.learner import (
    Conversation,
    Learner,
    LearnerConfig,
    StepMetrics,
    checkpoint_updates,
    existing_checkpoint,
    write_atomically,
)

REPORTED_CHECKPOINT = "learner"


def learner_worker(settings: dict[str, Any]) -> None:
    """One Ray Train worker's share of a rollout batch. `settings`: `learner` (a
    `LearnerConfig` as JSON), `start` (the checkpoint folder to resume from, or None for the
    initial policy) and `batch` (an object ref to (conversations, advantages), or None for a
    batch without signal, which only counts the update)."""
    import ray
    import ray.train
    import ray.train.torch

    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    device = ray.train.torch.get_device()
    config = LearnerConfig.model_validate(settings["learner"]).model_copy(
        update={"device": str(device)}
    )
    start = settings["start"]
    learner = Learner.resume(start, config) if start else Learner(config)
    learner.distribute(rank=rank, world_size=world_size, wrap=ray.train.torch.prepare_model)
    signal = None if settings["batch"] is None else ray.get(settings["batch"])
    learned = learner.learn(signal)
    metrics = {
        "updates": learner.updates,
        "global_step": learner.global_step,
        "learner": None if learned is None else learned.to_dict(),
    }
    if rank != 0:  # every worker reports: report is a barrier
        ray.train.report(metrics)
        return
    with tempfile.TemporaryDirectory(prefix="memstream-learner-") as folder:
        written = learner.save_checkpoint(Path(folder) / REPORTED_CHECKPOINT)
        checkpoint = ray.train.Checkpoint.from_directory(written)
        ray.train.report(
            metrics, checkpoint=checkpoint, checkpoint_dir_name=f"update-{learner.updates}"
        )


class RayTrainLearner:
    """The trainer's learner when it runs on Ray Train: `learn` has the in-process learner's
    contract (train or count the batch, then leave the checkpoint in `checkpoint`), one
    TorchTrainer run per call. Joins the Ray session at `address` (or $RAY_ADDRESS, a running
    one, else a local one) and leaves one it started at `close`."""

    def __init__(
        self,
        config: LearnerConfig,
        checkpoint: Path,
        *,
        storage: str | Path,
        workers: int = 1,
        gpus_per_worker: float = 0.0,
        cpus_per_worker: float = 1.0,
        address: str | None = None,
    ) -> None:
        import ray
        from ray.train import ScalingConfig

        self.config = config
        self.checkpoint = checkpoint
        self.storage = str(storage)
        resources = {"CPU": cpus_per_worker}
        if gpus_per_worker:
            resources["GPU"] = gpus_per_worker
        self.scaling = ScalingConfig(
            num_workers=workers, use_gpu=gpus_per_worker > 0, resources_per_worker=resources
        )
        self.updates = checkpoint_updates(checkpoint)
        self._started_ray = not ray.is_initialized()
        if self._started_ray:
            ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING)

    def learn(
        self, signal: tuple[Sequence[Conversation], Tensor | Sequence[float]] | None
    ) -> StepMetrics | None:
        import ray
        from ray.train import CheckpointConfig, RunConfig
        from ray.train.torch import TorchTrainer

        batch = None
        if signal is not None:
            conversations, advantages = signal
            batch = ray.put((list(conversations), torch.as_tensor(advantages)))
        start = existing_checkpoint(self.checkpoint)
        trainer = TorchTrainer(
            learner_worker,
            train_loop_config={
                "learner": self.config.model_dump(mode="json"),
                "start": None if start is None else str(start),
                "batch": batch,
            },
            scaling_config=self.scaling,
            run_config=RunConfig(
                name=f"update-{self.updates + 1}",
                storage_path=self.storage,
                checkpoint_config=CheckpointConfig(num_to_keep=1),
            ),
        )
        result = trainer.fit()
        reported = result.checkpoint
        if reported is None:
            raise RuntimeError(f"the Ray Train run in {result.path} reported no checkpoint")
        write_atomically(self.checkpoint, lambda folder: reported.to_directory(folder))
        result.filesystem.delete_dir(result.path)
        self.updates = int(result.metrics["updates"])
        learned = result.metrics["learner"]
        return None if learned is None else StepMetrics.from_dict(learned)

    def close(self) -> None:
        import ray

        if self._started_ray:
            ray.shutdown()
