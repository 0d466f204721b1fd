"""`memstream train --backend verl` on the CPU, without verl installed: the Parquet rows are the
native trainer's samples in verl's RL dataset schema, the reward file scores as the native
reward does when loaded by path as verl loads it, the trainer config only sets keys verl's
config has, a row's chain rolls out through a stand-in for verl's token server with the native
rollout code, and the RayJob manifest runs the exported files.

What needs verl itself (its config composed and validated, its dataset reader, its agent-loop
and reward-manager path) is `python -m pipeline.training.verl_check`, run where verl is
installed; what needs GPUs is in docs/guide/training.md.
"""

from __future__ import annotations

import ast
import asyncio
import importlib.util
import itertools
import os
from pathlib import Path, PurePosixPath
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from connectors.engines import models
from pipeline.cli.main import build_parser, main
from pipeline.training.config import TrainConfig
from pipeline.training.learner import Conversation
from pipeline.training.rollout import ChainRollout, reward_of
from pipeline.training.trainer import SampleSource, _overlong
from pipeline.training.verl_export import (
    AGENT_LOOPS_FILE,
    AGENT_NAME,
    CLUSTER_DIR,
    CONFIG_FILE,
    CONFIG_NAME,
    FILES,
    REWARD_FILE,
    TRAIN_FILE,
    VAL_FILE,
    VerlCluster,
    cluster_model,
    export_verl,
    training_samples,
)
from pipeline.training.verl_reward import MEMORY_LENGTHS
from pipeline.training.verl_rollout import ServerEngine, roll_out_row
from tests.test_infra import as_pod, core_errors, crd_errors, pod_templates

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = ROOT / "infra" / "k8s" / "rayjob-verl.yaml"
HOOKS = ROOT / "pipeline" / "training" / "verl_hooks.py"

# The keys of verl 0.9.1's trainer config that an export may set: a copy of key names from
# verl/trainer/config/_generated_ppo_trainer.yaml in the verl==0.9.1 wheel (the flattened
# ppo_trainer.yaml that `python -m verl.trainer.main_ppo` composes).
VERL_KEYS = frozenset(
    {
        "data.train_files", "data.val_files", "data.prompt_key", "data.train_batch_size",
        "data.max_prompt_length", "data.max_response_length", "data.filter_overlong_prompts",
        "data.truncation", "data.return_raw_chat", "data.shuffle", "data.seed",
        "actor_rollout_ref.model.path", "actor_rollout_ref.model.lora_rank",
        "actor_rollout_ref.model.lora_alpha", "actor_rollout_ref.model.target_modules",
        "actor_rollout_ref.actor.optim.lr", "actor_rollout_ref.actor.optim.lr_warmup_steps",
        "actor_rollout_ref.actor.optim.weight_decay", "actor_rollout_ref.actor.optim.clip_grad",
        "actor_rollout_ref.actor.ppo_mini_batch_size", "actor_rollout_ref.actor.ppo_epochs",
        "actor_rollout_ref.actor.use_dynamic_bsz",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
        "actor_rollout_ref.actor.clip_ratio_low", "actor_rollout_ref.actor.clip_ratio_high",
        "actor_rollout_ref.actor.clip_ratio_c", "actor_rollout_ref.actor.loss_agg_mode",
        "actor_rollout_ref.actor.entropy_coeff", "actor_rollout_ref.actor.use_kl_loss",
        "actor_rollout_ref.actor.kl_loss_coef", "actor_rollout_ref.actor.kl_loss_type",
        "actor_rollout_ref.rollout.name", "actor_rollout_ref.rollout.n",
        "actor_rollout_ref.rollout.temperature", "actor_rollout_ref.rollout.top_p",
        "actor_rollout_ref.rollout.calculate_log_probs",
        "actor_rollout_ref.rollout.tensor_model_parallel_size",
        "actor_rollout_ref.rollout.max_model_len",
        "actor_rollout_ref.rollout.agent.default_agent_loop",
        "actor_rollout_ref.rollout.agent.agent_loop_config_path",
        "algorithm.adv_estimator", "algorithm.norm_adv_by_std_in_grpo",
        "algorithm.use_kl_in_reward", "algorithm.filter_groups.enable",
        "algorithm.filter_groups.metric",
        "reward.custom_reward_function.path", "reward.custom_reward_function.name",
        "reward.reward_manager.source", "reward.reward_manager.name",
        "reward.reward_manager.module.path",
        "trainer.use_v1", "trainer.v1.trainer_mode", "trainer.total_epochs",
        "trainer.total_training_steps", "trainer.project_name", "trainer.experiment_name",
        "trainer.logger", "trainer.nnodes", "trainer.n_gpus_per_node", "trainer.save_freq",
        "trainer.test_freq", "trainer.val_before_train", "trainer.resume_mode",
        "trainer.default_local_dir",
    }
)  # fmt: skip


@pytest.fixture(scope="module")
def dapo_config(tmp_path_factory: pytest.TempPathFactory) -> TrainConfig:
    return TrainConfig(
        output=tmp_path_factory.mktemp("verl") / "facts",
        preset="dapo",
        steps=1,
        samples_per_step=2,
        group_size=4,
        n_segments=2,
        segment_tokens=100,
        n_distractors=1,
        chunk_size=100,
    )


@pytest.fixture(scope="module")
def export(dapo_config: TrainConfig, tokenizer, corpora) -> Path:  # type: ignore[no-untyped-def]
    cluster = VerlCluster(directory=PurePosixPath(dapo_config.output.resolve()))
    written = export_verl(dapo_config, cluster, val_samples=2, tokenizer=tokenizer)
    assert sorted(path.name for path in written) == sorted(FILES)
    return dapo_config.output


def rows(path: Path) -> list[dict[str, Any]]:
    return pq.read_table(path).to_pylist()


def test_train_rows_are_the_native_draws_in_verl_s_schema(  # type: ignore[no-untyped-def]
    export: Path, dapo_config: TrainConfig, tokenizer
) -> None:
    table = pq.read_table(export / TRAIN_FILE)
    # verl's RL dataset row: verl/utils/dataset/rl_dataset.py (prompt_key "prompt" as chat
    # messages, extra_info.index), the naive reward manager (data_source,
    # reward_model.ground_truth, extra_info) and agent_loop.py (agent_name).
    schema = table.schema
    assert schema.field("data_source").type == pa.string()
    assert schema.field("ability").type == pa.string()
    assert schema.field("agent_name").type == pa.string()
    message = schema.field("prompt").type.value_type
    assert {message.field(i).name for i in range(message.num_fields)} == {"role", "content"}
    assert schema.field("reward_model").type.field("ground_truth").type == pa.list_(pa.string())
    assert schema.field("extra_info").type.field("index").type == pa.int64()

    # With dynamic sampling a step may draw up to max_draws times: every draw, in order.
    source = SampleSource(dapo_config, tokenizer)
    draws = dapo_config.algorithm().max_draws
    expected = [s for d in range(draws) for s in source.draw(1, d)]
    exported = table.to_pylist()
    assert len(exported) == draws * dapo_config.samples_per_step == len(expected)
    for index, (row, sample) in enumerate(zip(exported, expected, strict=True)):
        assert row["agent_name"] == AGENT_NAME
        assert row["prompt"] == [{"role": "user", "content": sample.question}]
        assert row["reward_model"]["ground_truth"] == sample.answers
        info = row["extra_info"]
        assert info["index"] == index and info["split"] == "train"
        assert (info["sample_id"], info["document"]) == (sample.sample_id, sample.document)
        assert info["overlong_max_tokens"] == dapo_config.max_memory_tokens
    held_out = rows(export / VAL_FILE)
    assert held_out and {row["extra_info"]["split"] for row in held_out} == {"heldout"}
    assert not {r["extra_info"]["document"] for r in held_out} & {
        r["extra_info"]["document"] for r in exported
    }


def test_without_dynamic_sampling_a_step_is_its_first_draw(tokenizer, corpora) -> None:  # type: ignore[no-untyped-def]
    config = TrainConfig(
        output=Path("unused"), steps=2, samples_per_step=2, n_segments=2, segment_tokens=100
    )
    source = SampleSource(config, tokenizer)
    expected = [s for step in (1, 2) for s in source.draw(step, 0)]
    assert training_samples(config, tokenizer) == expected


def load_by_path(path: Path) -> Any:
    """As verl's load_extern_object does (verl/utils/import_utils.py, load_module): a spec from
    the file under a hashed name, executed, not put in sys.modules."""
    name = f"custom_module_{hash(os.path.abspath(path))}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_reward_file_scores_as_the_native_reward(export: Path) -> None:
    compute_score = load_by_path(export / REWARD_FILE).compute_score
    row = rows(export / TRAIN_FILE)[0]
    gold, info = row["reward_model"]["ground_truth"], dict(row["extra_info"])
    right = f"Therefore, the answer is {gold[0]}."
    wrong = "Therefore, the answer is 1234567."
    unformatted = f"The code is {gold[0]}."
    for reply in (right, wrong, unformatted):
        # The naive reward manager's call: verl/experimental/reward_loop/reward_manager/naive.py
        scored = compute_score(
            data_source=row["data_source"], solution_str=reply, ground_truth=gold, extra_info=info
        )
        assert scored["score"] == scored["acc"] == reward_of(reply, gold)
    assert reward_of(right, gold) == 1.0 and reward_of(wrong, gold) == 0.0
    raw = compute_score(row["data_source"], unformatted, gold, {**info, "raw_match": True})
    assert raw["score"] == reward_of(unformatted, gold, raw_match=True) == 1.0


def test_the_overlong_term_is_the_native_trainer_s(export: Path, dapo_config: TrainConfig) -> None:
    compute_score = load_by_path(export / REWARD_FILE).compute_score
    row = rows(export / TRAIN_FILE)[0]
    gold, info = row["reward_model"]["ground_truth"], dict(row["extra_info"])
    budget = dapo_config.max_memory_tokens
    lengths = [budget // 2, budget - 3, budget + 1]  # inside, in the ramp, past the budget
    # The agent loop leaves the lengths in the final output's extra_fields, which the naive
    # manager merges into extra_info.
    scored = compute_score(
        row["data_source"], f"the answer is {gold[0]}", gold, {**info, MEMORY_LENGTHS: lengths}
    )
    updates = tuple(Conversation(0, (1,), (2,) * length) for length in lengths)
    native = ChainRollout(0, (*updates, Conversation(0, (1,), (2,))), "", None, 1.0, ())
    assert scored["acc"] == 1.0
    assert scored["score"] == pytest.approx(1.0 + _overlong(dapo_config, native))
    assert scored["score"] < 1.0


def flatten(node: dict[str, Any], prefix: str = "") -> list[str]:
    keys = []
    for key, value in node.items():
        if isinstance(value, dict) and value:
            keys += flatten(value, f"{prefix}{key}.")
        else:
            keys.append(f"{prefix}{key}")
    return keys


def test_the_trainer_config_sets_only_keys_verl_has(export: Path, dapo_config: TrainConfig) -> None:
    config = yaml.safe_load((export / CONFIG_FILE).read_text())
    assert config["defaults"] == ["ppo_trainer", "_self_"]
    assert config["hydra"]["searchpath"] == ["pkg://verl.trainer.config"]
    body = {key: value for key, value in config.items() if key not in ("hydra", "defaults")}
    assert set(flatten(body)) <= VERL_KEYS
    for path in (
        config["data"]["train_files"],
        config["data"]["val_files"],
        config["reward"]["custom_reward_function"]["path"],
        config["actor_rollout_ref"]["rollout"]["agent"]["agent_loop_config_path"],
    ):
        assert Path(path).is_file()
    algorithm = dapo_config.algorithm()
    actor, rollout = config["actor_rollout_ref"]["actor"], config["actor_rollout_ref"]["rollout"]
    assert (actor["clip_ratio_low"], actor["clip_ratio_high"]) == (0.2, 0.28)
    assert actor["use_kl_loss"] is False and rollout["n"] == dapo_config.group_size
    assert config["algorithm"]["norm_adv_by_std_in_grpo"] is algorithm.normalize_advantage_std
    assert config["algorithm"]["filter_groups"] == {"enable": True, "metric": "acc"}
    assert config["trainer"]["use_v1"] is True  # the trainer that takes a list of outputs
    assert config["actor_rollout_ref"]["model"]["path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_the_hook_classes_the_files_name_exist(export: Path) -> None:
    """verl_hooks imports verl, which the suite does not have: its classes are read, not
    imported."""
    classes = {
        node.name: node
        for node in ast.parse(HOOKS.read_text()).body
        if isinstance(node, ast.ClassDef)
    }
    (entry,) = yaml.safe_load((export / AGENT_LOOPS_FILE).read_text())
    module, name = entry.pop("_target_").rsplit(".", 1)
    assert module == "pipeline.training.verl_hooks" and entry.pop("name") == AGENT_NAME
    init = next(f for f in classes[name].body if getattr(f, "name", "") == "__init__")
    assert set(entry) == {argument.arg for argument in init.args.kwonlyargs}
    manager = yaml.safe_load((export / CONFIG_FILE).read_text())["reward"]["reward_manager"]
    assert manager["module"]["path"] == "pkg://pipeline.training.verl_hooks"
    assert manager["name"] in classes


class TokenOutput:
    def __init__(self, token_ids: list[int], log_probs: list[float]) -> None:
        self.token_ids, self.log_probs = token_ids, log_probs


class FakeServer:
    """verl's LLMServerClient.generate as the agent loop calls it: prompt ids in, ids out."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.calls: list[tuple[list[int], int]] = []

    async def generate(
        self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any]
    ) -> TokenOutput:
        budget = sampling_params["max_tokens"]
        self.calls.append((prompt_ids, budget))
        ids = self.tokenizer.encode(f"Memory {len(self.calls)}: keep it.", add_special_tokens=False)
        ids = [*ids[: budget - 1], self.tokenizer.eos_token_id]
        return TokenOutput(ids, [-0.5] * len(ids))


def test_a_row_rolls_out_through_the_token_server_with_the_native_splicing(  # type: ignore[no-untyped-def]
    export: Path, dapo_config: TrainConfig, tokenizer
) -> None:
    row = rows(export / TRAIN_FILE)[0]
    server = FakeServer(tokenizer)
    engine = ServerEngine(server, tokenizer, {"temperature": 1.0, "logprobs": True})
    chain = asyncio.run(
        roll_out_row(engine, row["extra_info"], dapo_config.chain(), dapo_config.chunk_size)
    )
    updates, final = chain.conversations[:-1], chain.conversations[-1]
    assert len(updates) >= 2
    budgets = [budget for _, budget in server.calls]
    assert budgets == [dapo_config.max_memory_tokens] * len(updates) + [
        dapo_config.max_answer_tokens
    ]
    assert [list(c.prompt_ids) for c in chain.conversations] == [p for p, _ in server.calls]
    # Each memory enters the next prompt as its sampled ids without the end-of-sequence token.
    for before, after in itertools.pairwise(chain.conversations):
        memory = list(before.response_ids[:-1])
        prompt = list(after.prompt_ids)
        assert any(prompt[i : i + len(memory)] == memory for i in range(len(prompt)))
    assert chain.memory_lengths == tuple(len(c.response_ids) for c in updates)
    assert chain.response == tokenizer.decode(final.response_ids, skip_special_tokens=True)
    config = yaml.safe_load((export / CONFIG_FILE).read_text())
    longest = max(len(c.prompt_ids) for c in chain.conversations)
    assert longest <= config["data"]["max_prompt_length"]


def test_the_rayjob_runs_the_exported_files() -> None:
    documents = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]
    (claim,) = [d for d in documents if d["kind"] == "PersistentVolumeClaim"]
    (job,) = [d for d in documents if d["kind"] == "RayJob"]
    assert crd_errors(job) == [] and core_errors(claim) == []
    templates = pod_templates(job)
    for template in templates:
        assert core_errors(as_pod(template)) == []
    entrypoint = job["spec"]["entrypoint"].split()
    assert entrypoint[:3] == ["python3", "-m", "verl.trainer.main_ppo"]
    assert f"--config-path={CLUSTER_DIR}" in entrypoint
    assert f"--config-name={CONFIG_NAME}" in entrypoint
    for template in templates:
        spec = template["spec"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        for container in spec["containers"] + spec.get("initContainers", []):
            (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == str(CLUSTER_DIR)]
            claim_name = volumes[mount["name"]]["persistentVolumeClaim"]["claimName"]
            assert claim_name == claim["metadata"]["name"]
    (wait,) = job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["initContainers"]
    assert f"{CLUSTER_DIR}/{CONFIG_FILE}" in " ".join(wait["command"])
    header = MANIFEST.read_text().split("apiVersion")[0]
    for name in FILES:
        assert name in header


def test_the_cli_keeps_native_and_verl_flags_apart(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--output", "x", "--backend", "verl", "--learner", "ray-train"]) == 2
    assert "--learner: not used by --backend verl" in capsys.readouterr().err
    assert main(["train", "--output", "x", "--verl-nodes", "2"]) == 2
    assert "--verl-nodes: only with --backend verl" in capsys.readouterr().err
    train = build_parser()._subparsers._group_actions[0].choices["train"]  # type: ignore[union-attr]
    (cluster_dir,) = [a for a in train._actions if a.dest == "verl_cluster_dir"]
    assert f"(default: {CLUSTER_DIR}," in cluster_dir.help


def test_the_cli_exports_with_the_cluster_it_is_given(  # type: ignore[no-untyped-def]
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    seen: dict[str, Any] = {}

    def fake_export(config: TrainConfig, cluster: VerlCluster) -> list[Path]:
        seen.update(config=config, cluster=cluster)
        return [config.output / CONFIG_FILE]

    monkeypatch.setattr("pipeline.training.verl_export.export_verl", fake_export)
    argv = ["train", "--backend", "verl", "--output", str(tmp_path), "--group-size", "16"]
    assert main([*argv, "--verl-nodes", "4", "--verl-cluster-dir", "/mnt/run"]) == 0
    assert seen["config"].group_size == 16
    assert seen["cluster"] == VerlCluster(PurePosixPath("/mnt/run"), nodes=4, gpus_per_node=8)
    assert "--config-path=/mnt/run --config-name=memstream_verl" in capsys.readouterr().out


def test_verl_loads_a_packaged_model_s_hub_id_and_refuses_an_adapted_one(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    assert cluster_model("qwen2.5-coder-0.5b-instruct") == "Qwen/Qwen2.5-Coder-0.5B-Instruct"
    assert cluster_model("Qwen/Qwen2.5-7B-Instruct") == "Qwen/Qwen2.5-7B-Instruct"
    adapted = models.AdaptedModel(
        name="qwen2.5-coder-0.5b-memstream",
        base="qwen2.5-coder-0.5b-instruct",
        adapter_dir=tmp_path,
        adapter_sha256="0" * 64,
        trained_by="make train-default",
        license="Apache-2.0",
    )
    monkeypatch.setattr(models, "adapted_models", lambda: {adapted.name: adapted})
    with pytest.raises(models.ModelError, match=r"--model Qwen/Qwen2\.5-Coder-0\.5B-Instruct"):
        cluster_model(adapted.name)
