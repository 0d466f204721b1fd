"""`memstream train --backend verl`: the native trainer's run as verl's inputs, for GPU clusters.

From one `TrainConfig` it writes, into the output folder:

- train.parquet: the samples `memstream train` would draw, in its order (step by step, with
  DAPO's extra draws under dynamic sampling), one row each in verl's RL dataset schema;
- val.parquet: the task's held-out samples, as `score_heldout` draws them;
- reward.py: the reward function verl loads by path (pipeline.training.verl_reward);
- agent_loops.yaml: the memory agent loop (pipeline.training.verl_hooks) with the chain's
  template, chunk size and budgets;
- memstream_verl.yaml: a Hydra config over verl's `ppo_trainer` that names all of them and maps
  the preset (clips, KL, advantage normalisation, group filter), the learner (learning rate,
  warm-up, mini-batches, epochs, LoRA) and the rollouts (group size, temperature, top_p).

The files name each other by their paths on the cluster (`VerlCluster.directory`), where
infra/k8s/rayjob-verl.yaml mounts the volume they are copied to. Written against verl 0.9.1;
the schema's sources are verl's own files, named where each part is built.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from connectors.engines import models
from operators.config import default_template
from operators.core.segmentation import SegmentationConfig, segment, tokenize
from operators.core.templates import get_template_set
from pipeline.training.config import TrainConfig
from pipeline.training.rollout import PromptSplicer, TrainingSample, load_tokenizer
from pipeline.training.trainer import SampleSource, task_samples
from pipeline.training.verl_reward import (
    ANSWER_MODE,
    OVERLONG_CACHE_TOKENS,
    OVERLONG_MAX_TOKENS,
    RAW_MATCH,
    overlong_cache_tokens,
)
from pipeline.training.verl_rollout import DOCUMENT, QUESTION, SAMPLE_ID

VERL_VERSION = "0.9.1"
CLUSTER_DIR = PurePosixPath("/data/memstream-verl")
TRAIN_FILE = "train.parquet"
VAL_FILE = "val.parquet"
REWARD_FILE = "reward.py"
AGENT_LOOPS_FILE = "agent_loops.yaml"
CONFIG_NAME = "memstream_verl"
CONFIG_FILE = f"{CONFIG_NAME}.yaml"
FILES = (TRAIN_FILE, VAL_FILE, REWARD_FILE, AGENT_LOOPS_FILE, CONFIG_FILE)
CHECKPOINTS_DIR = "checkpoints"
AGENT_NAME = "memstream_memory"
HOOKS_MODULE = "pipeline.training.verl_hooks"
AGENT_LOOP_CLASS = f"{HOOKS_MODULE}.MemoryAgentLoop"
REWARD_MANAGER_CLASS = "FinalConversationRewardManager"
REWARD_FUNCTION = "compute_score"
VAL_SAMPLES = 64
# A segment's text, re-encoded inside the template, may take a few tokens more than the ids it
# was cut from.
PROMPT_SLACK_TOKENS = 32
# Chains measured for the conversations a chain has (the optimiser steps a batch takes).
CHAINS_MEASURED = 32
SAVE_AND_TEST_FREQ = 10

# verl's RL dataset row (verl/utils/dataset/rl_dataset.py reads `prompt` as chat messages and
# `extra_info.index`; verl/experimental/agent_loop/agent_loop.py picks the loop by `agent_name`;
# the naive reward manager reads `data_source`, `reward_model.ground_truth` and `extra_info`),
# the columns of verl's own examples/data_preprocess/gsm8k_tool_agent_loop.py.
MESSAGE = pa.struct([("role", pa.string()), ("content", pa.string())])
REWARD_MODEL = pa.struct([("style", pa.string()), ("ground_truth", pa.list_(pa.string()))])
EXTRA_INFO = pa.struct(
    [
        ("split", pa.string()),
        ("index", pa.int64()),
        (SAMPLE_ID, pa.string()),
        (QUESTION, pa.string()),
        (DOCUMENT, pa.string()),
        (ANSWER_MODE, pa.string()),
        (RAW_MATCH, pa.bool_()),
        (OVERLONG_MAX_TOKENS, pa.int64()),
        (OVERLONG_CACHE_TOKENS, pa.int64()),
    ]
)
ROW_SCHEMA = pa.schema(
    [
        ("data_source", pa.string()),
        ("agent_name", pa.string()),
        ("prompt", pa.list_(MESSAGE)),
        ("ability", pa.string()),
        ("reward_model", REWARD_MODEL),
        ("extra_info", EXTRA_INFO),
    ]
)

REWARD_MODULE = f'''"""memstream's training reward for verl (reward.custom_reward_function), written
by `memstream train --backend verl`. The scoring is pipeline.training.verl_reward's, which calls
the native trainer's own reward, so the two cannot drift apart."""

from pipeline.training.verl_reward import {REWARD_FUNCTION}

__all__ = ["{REWARD_FUNCTION}"]
'''


@dataclass(frozen=True)
class VerlCluster:
    """Where the exported folder is on the cluster and what the run spans."""

    directory: PurePosixPath = CLUSTER_DIR
    nodes: int = 1
    gpus_per_node: int = 8


@dataclass(frozen=True)
class TokenBudgets:
    prompt: int  # the longest prompt of a conversation, its memory at full budget
    response: int  # the longest reply: a memory or an answer
    conversations_per_chain: float  # mean over the first chains: segments + 1


def export_verl(
    config: TrainConfig,
    cluster: VerlCluster = VerlCluster(),
    *,
    val_samples: int = VAL_SAMPLES,
    tokenizer: Any = None,
) -> list[Path]:
    """Writes verl's inputs for `config`'s run into `config.output`; returns the files."""
    if tokenizer is None:
        tokenizer = load_tokenizer(models.resolve(config.model))
    train = training_samples(config, tokenizer)
    val = heldout_samples(config, tokenizer, val_samples)
    output = config.output
    output.mkdir(parents=True, exist_ok=True)
    write_rows(dataset_rows(config, train, split="train"), output / TRAIN_FILE)
    write_rows(dataset_rows(config, val, split="heldout"), output / VAL_FILE)
    (output / REWARD_FILE).write_text(REWARD_MODULE)
    write_yaml(agent_loops(config), output / AGENT_LOOPS_FILE)
    budgets = token_budgets(config, tokenizer, [*train, *val])
    write_yaml(trainer_config(config, cluster, budgets), output / CONFIG_FILE)
    return [output / name for name in FILES]


def training_samples(config: TrainConfig, tokenizer: Any) -> list[TrainingSample]:
    """What the native trainer draws: step 1 to `steps`, and with dynamic sampling every draw
    a step may take, in that order (verl reads the rows in order, `data.shuffle` off)."""
    algorithm = config.algorithm()
    draws = algorithm.max_draws if algorithm.dynamic_sampling else 1
    source = SampleSource(config, tokenizer)
    return [
        sample
        for step in range(1, config.steps + 1)
        for draw in range(draws)
        for sample in source.draw(step, draw)
    ]


def heldout_samples(config: TrainConfig, tokenizer: Any, n: int) -> list[TrainingSample]:
    """The held-out samples `score_heldout` measures a run on, each once (the CUAD split has
    fewer labels than `n` and cycles over them)."""
    samples, seen = [], set()
    for sample in task_samples(config, tokenizer, n, split="heldout", seed=1):
        if (sample.document, sample.question) not in seen:
            seen.add((sample.document, sample.question))
            samples.append(sample)
    return samples


def data_source(config: TrainConfig) -> str:
    return "memstream/answers" if config.answers else f"memstream/{config.task}"


def dataset_rows(
    config: TrainConfig, samples: Sequence[TrainingSample], *, split: str
) -> list[dict[str, Any]]:
    """One verl row a sample. The prompt is the question alone: the agent loop builds each
    conversation from the document in extra_info, with the run's templates."""
    algorithm = config.algorithm()
    shaping = algorithm.overlong_shaping
    cache = overlong_cache_tokens(algorithm.overlong_cache_tokens, config.max_memory_tokens)
    return [
        {
            "data_source": data_source(config),
            "agent_name": AGENT_NAME,
            "prompt": [{"role": "user", "content": sample.question}],
            "ability": "memory",
            "reward_model": {"style": "rule", "ground_truth": list(sample.answers)},
            "extra_info": {
                "split": split,
                "index": index,
                SAMPLE_ID: sample.sample_id,
                QUESTION: sample.question,
                DOCUMENT: sample.document,
                ANSWER_MODE: sample.answer_mode,
                RAW_MATCH: config.raw_match,
                OVERLONG_MAX_TOKENS: config.max_memory_tokens if shaping else 0,
                OVERLONG_CACHE_TOKENS: cache,
            },
        }
        for index, sample in enumerate(samples)
    ]


def write_rows(rows: list[dict[str, Any]], path: Path) -> None:
    pq.write_table(pa.Table.from_pylist(rows, schema=ROW_SCHEMA), path)


def template_name(config: TrainConfig) -> str:
    return config.template or default_template(config.model)


def agent_loops(config: TrainConfig) -> list[dict[str, Any]]:
    """verl's agent-loop file (`rollout.agent.agent_loop_config_path`): each entry is a
    registry name and the Hydra target verl instantiates with the other keys as arguments."""
    return [
        {
            "name": AGENT_NAME,
            "_target_": AGENT_LOOP_CLASS,
            "template": template_name(config),
            "chunk_size": config.chunk_size,
            "max_memory_tokens": config.max_memory_tokens,
            "max_answer_tokens": config.max_answer_tokens,
        }
    ]


def token_budgets(
    config: TrainConfig, tokenizer: Any, samples: Sequence[TrainingSample]
) -> TokenBudgets:
    """A conversation's prompt is at most the template around the question, a chunk and a
    memory at full budget (a memory enters as its sampled ids, so its tokens add up)."""
    templates = get_template_set(template_name(config))
    splicer = PromptSplicer(tokenizer)
    around = max(
        max(
            len(splicer.chat_ids(templates.render_update(sample.question, "", ""))),
            len(splicer.chat_ids(templates.render_final(sample.question, ""))),
        )
        for sample in samples
    )
    segmentation = SegmentationConfig(chunk_size=config.chunk_size)
    measured = samples[:CHAINS_MEASURED]
    segments = [
        len(segment(tokenize(s.sample_id, s.document, tokenizer), tokenizer, segmentation))
        for s in measured
    ]
    return TokenBudgets(
        prompt=around + config.chunk_size + config.max_memory_tokens + PROMPT_SLACK_TOKENS,
        response=max(config.max_memory_tokens, config.max_answer_tokens),
        conversations_per_chain=sum(segments) / len(segments) + 1,
    )


def cluster_model(model: str) -> str:
    """What verl loads: a packaged model's upstream hub id (its full-precision weights, not
    the GGUF the CPU engine dequantizes), else the name as given (a hub id, or a path the
    cluster sees). An adapted model (a base plus a shipped adapter) has no hub id: refused."""
    if (adapted := models.adapted_models().get(model)) is not None:
        raise models.ModelError(
            f"{model!r} is {adapted.base!r} with memstream's LoRA adapter, merged when pulled; "
            f"verl loads a hub id or a folder the cluster sees: pass --model "
            f"{cluster_model(adapted.base)} to train from the base, or the merged folder "
            f"(`memstream models pull {model}` writes it) copied where the cluster reads it"
        )
    packaged = models.PACKAGED_MODELS.get(model)
    return packaged.upstream.split(" ")[0] if packaged else model


def trainer_config(
    config: TrainConfig, cluster: VerlCluster, budgets: TokenBudgets
) -> dict[str, Any]:
    """verl's trainer config over its defaults (verl/trainer/config/ppo_trainer.yaml; every key
    is one of _generated_ppo_trainer.yaml's). The v1 trainer is the one that takes several
    outputs from an agent loop."""
    algorithm = config.algorithm()
    learner = config.learner_config(config.model)
    here = cluster.directory
    # verl's mini-batch is ppo_mini_batch_size prompts x rollout.n rows (conversations here),
    # the native one `mini_batch_conversations` conversations.
    mini_batch_prompts = min(
        config.samples_per_step, max(1, round(config.mini_batch_conversations / config.group_size))
    )
    rows_per_batch = config.samples_per_step * config.group_size * budgets.conversations_per_chain
    optimiser_steps = math.ceil(rows_per_batch / (mini_batch_prompts * config.group_size))
    optimiser_steps *= config.epochs_per_batch
    # verl's scheduler steps once per rollout batch; the native warm-up counts optimiser steps.
    warmup_batches = math.ceil(config.warmup_steps / optimiser_steps)
    sequence_tokens = budgets.prompt + budgets.response
    model: dict[str, Any] = {"path": cluster_model(config.model)}
    if config.lora:
        model |= {
            "lora_rank": config.lora_rank,
            "lora_alpha": config.lora_alpha,
            "target_modules": "all-linear",
        }
    return {
        "hydra": {"searchpath": ["pkg://verl.trainer.config"]},
        "defaults": ["ppo_trainer", "_self_"],
        "data": {
            "train_files": str(here / TRAIN_FILE),
            "val_files": str(here / VAL_FILE),
            "prompt_key": "prompt",
            "train_batch_size": config.samples_per_step,
            "max_prompt_length": budgets.prompt,
            "max_response_length": budgets.response,
            "filter_overlong_prompts": False,
            "truncation": "error",
            "return_raw_chat": True,
            "shuffle": False,
            "seed": config.seed,
        },
        "actor_rollout_ref": {
            "model": model,
            "actor": {
                "optim": {
                    "lr": learner.learning_rate,
                    "lr_warmup_steps": warmup_batches,
                    "weight_decay": learner.weight_decay,
                    "clip_grad": learner.grad_clip,
                },
                "ppo_mini_batch_size": mini_batch_prompts,
                "ppo_epochs": config.epochs_per_batch,
                "use_dynamic_bsz": True,
                "ppo_max_token_len_per_gpu": max(16384, sequence_tokens),
                "clip_ratio_low": algorithm.clip_low,
                "clip_ratio_high": algorithm.clip_high,
                "clip_ratio_c": algorithm.dual_clip,
                "loss_agg_mode": "token-mean",
                "entropy_coeff": algorithm.entropy_coef,
                "use_kl_loss": algorithm.kl_coef > 0,
                "kl_loss_coef": algorithm.kl_coef,
                "kl_loss_type": algorithm.kl_estimator,
            },
            "rollout": {
                "name": "vllm",
                "n": config.group_size,
                "temperature": config.temperature,
                "top_p": config.top_p,
                "calculate_log_probs": True,
                "tensor_model_parallel_size": 1,
                "max_model_len": sequence_tokens,
                "agent": {
                    "default_agent_loop": AGENT_NAME,
                    "agent_loop_config_path": str(here / AGENT_LOOPS_FILE),
                },
            },
        },
        "algorithm": {
            "adv_estimator": "grpo",
            "norm_adv_by_std_in_grpo": algorithm.normalize_advantage_std,
            "use_kl_in_reward": False,
            "filter_groups": {"enable": algorithm.dynamic_sampling, "metric": "acc"},
        },
        "reward": {
            "custom_reward_function": {"path": str(here / REWARD_FILE), "name": REWARD_FUNCTION},
            "reward_manager": {
                "source": "importlib",
                "name": REWARD_MANAGER_CLASS,
                "module": {"path": f"pkg://{HOOKS_MODULE}"},
            },
        },
        "trainer": {
            "use_v1": True,
            "v1": {"trainer_mode": "sync"},
            "total_epochs": 1,
            "total_training_steps": config.steps,
            "project_name": "memstream",
            "experiment_name": config.output.name,
            "logger": ["console"],
            "nnodes": cluster.nodes,
            "n_gpus_per_node": cluster.gpus_per_node,
            "save_freq": SAVE_AND_TEST_FREQ,
            "test_freq": SAVE_AND_TEST_FREQ,
            "val_before_train": True,
            "resume_mode": "auto",
            "default_local_dir": str(here / CHECKPOINTS_DIR),
        },
    }


def write_yaml(document: object, path: Path) -> None:
    header = f"# Written by `memstream train --backend verl` for verl {VERL_VERSION}.\n"
    path.write_text(header + yaml.safe_dump(document, sort_keys=False))
