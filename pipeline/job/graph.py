"""The Ray Data graph: the sources' read, then parse, segment and the memory actor pool; with
collections, a second branch from the parsed documents: one group per collection, segmented
as one document, into the same memory actors."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from connectors import Source
from connectors.reading import SourceDatasource
from pipeline.job.plan import JobPlan
from pipeline.job.summary import Tally
from pipeline.stages.collection import COLLECTION_COLUMN, CollectionMembers, CollectionStage
from pipeline.stages.memory import ENGINE_ACTOR_ENV, MemoryStage
from pipeline.stages.read import ReadParseStage
from pipeline.stages.run import RunContext
from pipeline.stages.segment import SegmentStage

# Ray Data's target block size, in bytes: any row fills a block, so each block holds one.
ONE_DOCUMENT_PER_BLOCK = 1


def stream(plan: JobPlan, run: RunContext, tally: Tally) -> None:
    dataset = _build_dataset(plan, run)
    for batch in dataset.iter_batches(batch_format="pyarrow", batch_size=None):
        tally.add(batch.to_pylist())


def read_sources(sources: Sequence[Source], read_tasks: int) -> Any:
    """The sources' documents as a Ray Dataset (DOCUMENT_SCHEMA rows), read by Ray tasks
    (`connectors.reading.BLOCK_BYTES` of documents at a time), flowing on one to a block."""
    import ray

    context = ray.data.DataContext.get_current()
    # Blocks done per operator say little here; progress comes from the state store instead.
    context.enable_progress_bars = False
    # A stage's error reaches the driver as itself (within a RayTaskError), not as a
    # UserCodeException that keeps it only as text: a StateStoreError stops the job in one line.
    context.raise_original_map_exception = True
    datasource = SourceDatasource(sources, parallelism=read_tasks)
    # One output block count per shard: more would make Ray split each block of the read
    # into pieces (one row each, here), whatever their size.
    dataset = ray.data.read_datasource(datasource, override_num_blocks=len(datasource.shards))
    # The dataset's own copy of the context: every stage after the read puts each document in
    # a block of its own. Ray Data gives a block to one task, whose batches an async stage
    # runs at most four at a time, so documents sharing a block would wait for each other:
    # each document its own memory-stage task puts every one the actor's window allows in
    # its hands at once, for longest-first to choose among (with the default 128 MiB, a few
    # blocks would hold a whole corpus of small documents).
    dataset.context.target_max_block_size = ONE_DOCUMENT_PER_BLOCK
    return dataset


def _build_dataset(plan: JobPlan, run: RunContext) -> Any:
    from ray.data import ActorPoolStrategy, TaskPoolStrategy

    concurrency = plan.spec.concurrency
    dataset = read_sources(plan.sources, concurrency.read_tasks)
    read_compute = TaskPoolStrategy(size=concurrency.read_tasks)
    parsed = dataset.map_batches(
        ReadParseStage(plan.sources, run, keep_failed=bool(run.collections)),
        batch_format="pyarrow",
        batch_size=1,
        compute=read_compute,
        num_cpus=0.5,
    )
    if run.collections:
        # Both branches read the parsed documents: held once in the object store rather than
        # read and parsed twice. The documents' chains start once every document is parsed.
        parsed = parsed.materialize()
    dataset = parsed.map_batches(
        SegmentStage(run),
        batch_format="pyarrow",
        batch_size=1,
        compute=read_compute,
        num_cpus=0.5,
    )
    if run.collections:
        dataset = dataset.union(_collections(parsed, run, read_compute))
    in_flight = concurrency.batches_in_flight
    return dataset.map_batches(
        MemoryStage,
        fn_constructor_kwargs={
            "run": run,
            "max_active_chains": concurrency.max_active_chains,
            "longest_first": concurrency.schedule == "longest-first",
        },
        batch_format="pyarrow",
        batch_size=concurrency.batch_size,
        # Several calls run at once in each actor: an async __call__ shares the actor's event
        # loop and engine, so a long document does not hold the next ones back.
        compute=ActorPoolStrategy(
            size=concurrency.actors,
            max_tasks_in_flight_per_actor=in_flight,
            max_concurrent_calls_per_actor=in_flight,
        ),
        num_cpus=concurrency.num_cpus,
        num_gpus=concurrency.num_gpus or None,
        runtime_env={"env_vars": ENGINE_ACTOR_ENV},
    )


def _collections(parsed: Any, run: RunContext, compute: Any) -> Any:
    """Each collection's members grouped by its name (a shuffle: a collection is read once all
    its members are parsed), then segmented and planned as one document per collection."""
    members = parsed.map_batches(
        CollectionMembers(run.collections),
        batch_format="pyarrow",
        batch_size=1,
        compute=compute,
        num_cpus=0.5,
    )
    # map_groups takes a function (or a class to construct): the stage's bound call.
    # One partition per collection at most: Ray's default (200) is as many reduce tasks.
    grouped = members.groupby(COLLECTION_COLUMN, num_partitions=len(run.collections))
    return grouped.map_groups(CollectionStage(run).__call__, batch_format="pyarrow", num_cpus=0.5)


def ensure_ray(address: str | None) -> bool:
    """Joins the running Ray session, or starts one; True when this call started it."""
    import ray

    if ray.is_initialized():
        return False
    ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING)
    return True
