"""The classes verl's workers instantiate for a memstream run: the memory agent loop and the
reward manager that scores its final conversation.

Imports verl (the `verl` extra; written against verl 0.9.1). The files `memstream train
--backend verl` writes name these classes: the agent-loop file (with the chain's settings as
keyword arguments) and the trainer config's `reward.reward_manager`.

`MemoryAgentLoop.run` rolls out the row's chain (pipeline.training.verl_rollout) and returns
its K update conversations and its final one as separate `AgentLoopOutput`s, the list verl's v1
trainer (`trainer.use_v1`) takes from an agent loop (verl/trainer/ppo/v1/agent_loop_tq.py): it
scores the last one with the reward function, gives every output that reward, and broadcasts
the GRPO advantage of the final conversation to the others
(`compute_advantage_for_multi_trajectories`, verl/trainer/ppo/v1/utils.py): Multi-Conv DAPO's
broadcast.
"""

from __future__ import annotations

import time
from typing import Any

from verl import DataProto
from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopOutput
from verl.experimental.reward_loop.reward_manager.naive import NaiveRewardManager

from operators.core.chain import ChainConfig
from operators.core.templates import get_template_set
from pipeline.training.verl_reward import MEMORY_LENGTHS
from pipeline.training.verl_rollout import ServerEngine, roll_out_row


class MemoryAgentLoop(AgentLoopBase):
    def __init__(
        self,
        *args: Any,
        template: str,
        chunk_size: int,
        max_memory_tokens: int,
        max_answer_tokens: int,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.chain_config = ChainConfig(
            templates=get_template_set(template),
            max_memory_tokens=max_memory_tokens,
            max_answer_tokens=max_answer_tokens,
        )
        self.chunk_size = chunk_size

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> list[AgentLoopOutput]:
        started = time.perf_counter()
        engine = ServerEngine(self.server_manager, self.tokenizer, sampling_params)
        chain = await roll_out_row(engine, kwargs["extra_info"], self.chain_config, self.chunk_size)
        seconds = time.perf_counter() - started
        outputs = [
            AgentLoopOutput(
                prompt_ids=list(conversation.prompt_ids),
                response_ids=list(conversation.response_ids),
                response_mask=[1] * len(conversation.response_ids),
                response_logprobs=(
                    None
                    if conversation.rollout_logprobs is None
                    else list(conversation.rollout_logprobs)
                ),
                num_turns=2,
                metrics={"generate_sequences": seconds},
                extra_fields={"turn_scores": [], "tool_rewards": []},
            )
            for conversation in chain.conversations
        ]
        outputs[-1].extra_fields[MEMORY_LENGTHS] = list(chain.memory_lengths)
        return outputs


class FinalConversationRewardManager(NaiveRewardManager):
    """verl's naive reward manager on the chain's final conversation, cut to its own length.

    verl pads a chain's outputs to the longest before scoring them, and the naive manager reads
    the last output's reply length at the end of that padding: a final conversation shorter
    than the chain's updates (the usual case: a question and a memory against a chunk) would be
    scored on an empty reply. Seen with verl 0.9.1 on the CPU."""

    async def run_single(self, data: DataProto) -> dict:
        final = data[-1:]
        reply_lengths = final.non_tensor_batch.get("response_len")
        if reply_lengths is None:
            return await super().run_single(data)
        reply = int(reply_lengths[0])
        total = int(final.batch["attention_mask"][0].sum())
        trimmed = DataProto.from_dict(
            tensors={
                "responses": final.batch["responses"][:, :reply],
                "attention_mask": final.batch["attention_mask"][:, :total],
            },
            non_tensors=dict(final.non_tensor_batch),
        )
        return await super().run_single(trimmed)
