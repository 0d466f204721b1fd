"""Reinforcement learning of the memory policy (Multi-Conv DAPO), from the bottom up:

algorithm.py  advantages, the clipped token-mean loss, the group filter: pure torch functions
tasks.py      the synthetic keep-the-fact task on real prose, with train and held-out splits
needle_facts.py  NIAH's multi-key and multi-value needles among distractors, on the same prose
table_figures.py figures of table rows: synthetic headed rows in prose, and the 10-Q filings'
rollout.py    memory chains sampled through the engine, kept as token ids
learner.py    the causal LM in fp32 and its optimiser: one step per rollout batch
config.py     `memstream train`'s settings (one pydantic model; the flags come from it)
trainer.py    the loop: roll out, learn, checkpoint, reload the engine from the checkpoint
"""
