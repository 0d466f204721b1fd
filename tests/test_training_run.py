"""Training on the real engine and a real small model: rollouts as token ids, two resumable
steps of `memstream train`, the weight sync the second step's rollouts came from, and rollouts
on a Ray actor pool of engines."""

from __future__ import annotations

import asyncio
import itertools
import json
from pathlib import Path

import pytest
import torch

from connectors.engines.factory import open_engine
from operators.core.chain import ChainConfig, MemoryChain
from operators.core.segmentation import SegmentationConfig, segment, tokenize
from operators.core.templates import get_template_set
from operators.engine import Completion, GenerationRequest, SamplingConfig
from pipeline.cli.main import build_parser
from pipeline.training.algorithm import TrainingAlgorithmConfig
from pipeline.training.config import TrainConfig
from pipeline.training.curve import CURVE_FILE
from pipeline.training.learner import Conversation, Learner, LearnerConfig
from pipeline.training.rollout import (
    PromptSplicer,
    reward_of,
    roll_out_chain,
    roll_out_samples,
    rollout_engine_spec,
)
from pipeline.training.rollout_engines import shares
from pipeline.training.trainer import (
    CHECKPOINT_DIR,
    HELDOUT_FILE,
    METRICS_FILE,
    ROLLOUTS_DIR,
    SampleSource,
    draw_learning_curve,
    read_rollouts,
    run_training,
)

DOCUMENT = (
    "The harbour office opens at nine. The access code for the amber tower vault is 4417302. "
    "Ships unload on the north quay; the south quay is closed for repairs until spring. "
    "The access code for the jade river vault is 9021154. Visitors sign in at the gate."
)


def test_reward_reads_the_answer_and_raw_match_the_whole_reply() -> None:
    assert reward_of("so the answer is 4417302.", ["4417302"]) == 1.0
    assert reward_of("the answer is 9021154", ["4417302"]) == 0.0
    assert reward_of("The code is 4417302", ["4417302"]) == 0.0
    assert reward_of("The code is 4417302", ["4417302"], raw_match=True) == 1.0


def test_memory_ids_enter_the_next_prompt_as_sampled(  # type: ignore[no-untyped-def]
    vllm_engine, event_loop_runner, tokenizer
) -> None:
    segments = segment(
        tokenize("doc", DOCUMENT, tokenizer), tokenizer, SegmentationConfig(chunk_size=24)
    )
    chain = MemoryChain(
        "c", "What is the access code for the amber tower vault?", segments,
        ChainConfig(max_memory_tokens=16, max_answer_tokens=16),
    )  # fmt: skip
    splicer = PromptSplicer(tokenizer)
    conversations, response, hit_budget = event_loop_runner.run(
        roll_out_chain(vllm_engine, splicer, chain, SamplingConfig(temperature=1.0, seed=3), 0)
    )
    assert len(conversations) == len(segments) + 1 and len(hit_budget) == len(segments)
    assert response == chain.raw_response
    spliced = 0
    for previous, current in itertools.pairwise(conversations):
        assert current.rollout_logprobs is not None
        assert len(current.rollout_logprobs) == len(current.response_ids)
        memory = list(previous.response_ids)
        if memory[-1] in splicer.end_ids:
            memory.pop()
        prompt = list(current.prompt_ids)
        found = any(prompt[i : i + len(memory)] == memory for i in range(len(prompt)))
        spliced += found
    # Every memory that came back as the model wrote it is spliced in as its sampled ids.
    assert spliced >= 1


def test_a_template_that_does_not_show_the_memory_gets_its_prompt_as_rendered(  # type: ignore[no-untyped-def]
    tokenizer,
) -> None:
    """verified-quotes' update prompt holds the question and the chunk, not the memory: a
    memory's sampled ids have nowhere to go, and the prompt is the chain's own."""
    segments = segment(
        tokenize("doc", DOCUMENT, tokenizer), tokenizer, SegmentationConfig(chunk_size=24)
    )
    quotes = get_template_set("verified-quotes")
    config = ChainConfig(templates=quotes, max_memory_tokens=16, max_answer_tokens=16)
    chain = MemoryChain("c", "What is the access code for the amber tower vault?", segments, config)
    splicer = PromptSplicer(tokenizer)
    request = chain.next_request()
    assert request is not None
    assert splicer.prompt_ids(chain, request, [15, 16]) == splicer.chat_ids(request.prompt)


def test_the_engine_takes_prompt_ids_and_reports_what_it_sampled(  # type: ignore[no-untyped-def]
    vllm_engine, event_loop_runner, tokenizer
) -> None:
    ids = tuple(PromptSplicer(tokenizer).chat_ids("Say one word."))
    completion = event_loop_runner.run(
        vllm_engine.generate(
            GenerationRequest("ids", "(ids)", 6, prompt_token_ids=ids, logprobs=True)
        )
    )
    assert completion.prompt_token_ids == ids and completion.prompt_tokens == len(ids)
    assert len(completion.token_ids) == completion.completion_tokens > 0
    assert completion.logprobs is not None and len(completion.logprobs) == len(completion.token_ids)
    assert all(logprob <= 0.0 for logprob in completion.logprobs)


def test_train_help_lists_the_config_s_fields() -> None:
    parser = build_parser()
    train = parser._subparsers._group_actions[0].choices["train"]  # type: ignore[union-attr]
    flags = {option for action in train._actions for option in action.option_strings}
    expected = {"--" + name.replace("_", "-") for name in TrainConfig.model_fields}
    assert expected <= flags and "--no-raw-match" in flags
    args = parser.parse_args(["train", "--output", "x", "--preset", "dapo", "--steps", "3"])
    assert (args.output, args.preset, args.steps) == ("x", "dapo", 3)
    with pytest.raises(SystemExit):
        parser.parse_args(["train", "--output", "x", "--preset", "ppo"])


def test_lora_flags_reach_the_learner() -> None:
    from pipeline.cli.flags import model_from_flags

    args = build_parser().parse_args(
        ["train", "--output", "x", "--lora", "--lora-rank", "4", "--lora-alpha", "8"]
    )
    learner = model_from_flags(TrainConfig, args).learner_config("base-model")
    assert (learner.lora, learner.lora_rank, learner.lora_alpha) == (True, 4, 8.0)
    assert not TrainConfig(output=Path("x")).learner_config("base-model").lora


def test_shares_split_a_draw_into_contiguous_near_equal_ranges() -> None:
    assert shares(5, 2) == [(0, 3), (3, 5)]
    assert shares(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert shares(1, 3) == [(0, 1), (1, 1), (1, 1)]


class SeedEcho:
    """Replies with the seed it was asked to sample with: which chain got which seed."""

    model = "seed-echo"

    async def generate(self, request: GenerationRequest) -> Completion:
        ids = request.prompt_token_ids
        return Completion(
            request.request_id, f"seed {request.sampling.seed}", len(ids), 1, "stop", 0.0,
            prompt_token_ids=ids, token_ids=(request.sampling.seed,), logprobs=(0.0,),
        )  # fmt: skip


def test_a_share_of_a_draw_samples_what_the_whole_draw_does(tmp_path: Path, tokenizer) -> None:  # type: ignore[no-untyped-def]
    """What lets a pool split a draw among its actors: a group's chains are seeded by the
    group's place in the draw, whichever share it is rolled out in."""
    config = TrainConfig(
        output=tmp_path, samples_per_step=5, group_size=2, n_segments=1, segment_tokens=60,
        n_distractors=1, chunk_size=64,
    )  # fmt: skip
    samples = SampleSource(config, tokenizer).draw(step=3, draw=1)
    splicer = PromptSplicer(tokenizer)

    def roll(share: list, first_group: int) -> list:  # type: ignore[type-arg]
        return asyncio.run(
            roll_out_samples(
                SeedEcho(),
                splicer,
                config,
                share,
                tokenizer,
                3,
                1,
                first_group=first_group,  # type: ignore[arg-type]
            )
        )

    whole = roll(samples, 0)
    split = [group for first, end in shares(5, 2) for group in roll(samples[first:end], first)]
    assert split == whole
    assert [rollout.group for group in whole for rollout in group] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    seeds = [rollout.response for group in whole for rollout in group]
    assert len(set(seeds)) == 10  # every chain its own seed
    assert roll(samples[3:], 0) != whole[3:]  # the offset is what keeps them


def test_the_learning_curve_is_drawn_from_the_run_s_lines(tmp_path: Path) -> None:
    (tmp_path / METRICS_FILE).write_text(
        "".join(json.dumps({"step": k, "reward_mean": k / 10}) + "\n" for k in (1, 2, 3))
    )
    draw_learning_curve(tmp_path, log=pytest.fail)
    alone = (tmp_path / CURVE_FILE).read_bytes()
    (tmp_path / HELDOUT_FILE).write_text(json.dumps({"step": 0, "strict": 0.3}) + "\n")
    draw_learning_curve(tmp_path, log=pytest.fail)
    assert alone.startswith(b"\x89PNG") and (tmp_path / CURVE_FILE).read_bytes() != alone
    messages: list[str] = []
    (tmp_path / METRICS_FILE).write_text(json.dumps({"step": 4}) + "\n")  # no reward: logged
    draw_learning_curve(tmp_path, log=messages.append)
    assert messages and "learning curve not drawn" in messages[0]


@pytest.mark.engine
def test_two_steps_run_and_resume_on_the_real_engine(tmp_path: Path) -> None:
    config = TrainConfig(
        output=tmp_path / "run", steps=1, samples_per_step=1, group_size=2, n_segments=2,
        segment_tokens=40, n_distractors=1, chunk_size=56, max_memory_tokens=16,
        max_answer_tokens=12, learning_rate=5e-4, warmup_steps=0, mini_batch_conversations=3,
        raw_match=True, max_model_len=1024,
    )  # fmt: skip
    first = run_training(config, log=lambda message: None)
    with pytest.raises(FileExistsError):
        run_training(config, log=lambda message: None)
    second = run_training(
        config.model_copy(update={"steps": 2, "resume": True}), log=lambda message: None
    )
    assert [row["step"] for row in first + second] == [1, 2]
    assert (config.output / CURVE_FILE).stat().st_size > 0  # redrawn after every step
    logged = [json.loads(line) for line in (config.output / METRICS_FILE).read_text().splitlines()]
    assert [row["step"] for row in logged] == [1, 2]
    for step, row in enumerate(logged, start=1):
        rollouts = read_rollouts(config.output / ROLLOUTS_DIR / f"step-{step}.jsonl")
        assert len(rollouts) == 2 and {r.group for r in rollouts} == {0}
        assert row["reward_mean"] == sum(r.reward for r in rollouts) / 2
        # Chains whose rewards differ are learnt from; equal rewards give no optimiser step.
        learnt = len({r.reward for r in rollouts}) > 1
        assert ("learner_loss" in row) == learnt
        if learnt:  # the engine (reloaded from the checkpoint) and the learner agree
            assert row["learner_rollout_logprob_abs_diff"] < 1e-2
    assert (config.output / CHECKPOINT_DIR / "config.json").is_file()


@pytest.mark.engine
def test_a_weight_sync_brings_the_engine_to_the_learner(  # type: ignore[no-untyped-def]
    tmp_path: Path, tokenizer, vllm_engine, event_loop_runner
) -> None:
    """After a learner step that moves its log-probabilities by more than 1e-2 nats a token,
    the engine reloaded from the learner's export gives the learner's (float32 both: within
    1e-2)."""
    config = TrainConfig(output=tmp_path / "run", max_model_len=512)
    prompt = tuple(PromptSplicer(tokenizer).chat_ids("Name one colour of the sky."))
    request = GenerationRequest("sync", "(ids)", 8, prompt_token_ids=prompt, logprobs=True)

    def conversation(completion: Completion) -> Conversation:
        return Conversation(0, prompt, completion.token_ids, completion.logprobs)

    async def sampled_on(weights: Path) -> Conversation:
        engine = open_engine(rollout_engine_spec(config, weights))
        try:
            return conversation(await engine.generate(request))
        finally:
            await engine.shutdown()

    before = conversation(event_loop_runner.run(vllm_engine.generate(request)))  # the base model
    learner = _learner_on_the_base_model(config)
    (moved_from,) = learner.response_logprobs([before])
    learner.step([before], [1.0])
    (moved_to,) = learner.response_logprobs([before])
    assert float((moved_to - moved_from).abs().mean()) > 1e-2  # else the check below proves nothing

    after = asyncio.run(sampled_on(learner.export_weights(tmp_path / "weights")))
    (mine,) = learner.response_logprobs([after])
    assert float((mine - torch.tensor(after.rollout_logprobs)).abs().mean()) < 1e-2


def _learner_on_the_base_model(config: TrainConfig) -> Learner:
    return Learner(
        LearnerConfig(
            model=_base(config), learning_rate=1e-3, warmup_steps=0,
            algorithm=TrainingAlgorithmConfig.preset("dapo"),
        )
    )  # fmt: skip


def _base(config: TrainConfig) -> str:
    from connectors.engines import models

    return models.resolve(config.model)


@pytest.mark.engine
def test_rollouts_on_a_ray_actor_pool_sample_the_draw_on_the_step_s_weights(  # type: ignore[no-untyped-def]
    tmp_path: Path, tokenizer
) -> None:
    """A step with `--rollout-actors 1`: the engine runs in a Ray actor. Each group's chains
    read that group's sample of the draw, their rewards score their replies, the
    log-probabilities the actor reported are the base weights' (the learner on them agrees
    within 1e-2 nats a token), and the learner then trains on them as on any.

    The sampled tokens are not compared with an in-process engine's: on CPU a sampled request
    draws from the engine's seeded stream (connectors.engines.vllm_local), so what it samples
    depends on how the engine happened to batch it, and two runs agree only when their
    batches did. That a share of a draw gets its groups' seeds is
    test_a_share_of_a_draw_samples_what_the_whole_draw_does."""
    import ray

    config = TrainConfig(
        output=tmp_path / "run", steps=1, samples_per_step=2, group_size=2, n_segments=2,
        segment_tokens=60, n_distractors=1, chunk_size=76, max_memory_tokens=16,
        max_answer_tokens=12, learning_rate=5e-4, warmup_steps=0, mini_batch_conversations=4,
        raw_match=True, max_model_len=1024, rollout_actors=1,
    )  # fmt: skip
    (row,) = run_training(config, log=lambda message: None)
    assert not ray.is_initialized()  # the pool ended the session it started
    pooled = read_rollouts(config.output / ROLLOUTS_DIR / "step-1.jsonl")
    assert [rollout.group for rollout in pooled] == [0, 0, 1, 1]
    assert row["step"] == 1 and (config.output / CHECKPOINT_DIR / "config.json").is_file()

    samples = SampleSource(config, tokenizer).draw(step=1, draw=0)
    learner = _learner_on_the_base_model(config)
    for rollout in pooled:
        sample = samples[rollout.group]
        first_prompt = tokenizer.decode(rollout.conversations[0].prompt_ids)
        assert sample.question in first_prompt
        assert sample.document.split()[0] in first_prompt
        assert rollout.reward == reward_of(
            rollout.response, sample.answers, raw_match=True, answer_mode=sample.answer_mode
        )
        mine = learner.response_logprobs(rollout.conversations)
        for conversation, logprobs in zip(rollout.conversations, mine, strict=True):
            reported = torch.tensor(conversation.rollout_logprobs)
            assert float((logprobs - reported).abs().mean()) < 1e-2
    assert samples[0].question != samples[1].question or samples[0].document != samples[1].document
