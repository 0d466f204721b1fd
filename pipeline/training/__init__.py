"""Reinforcement learning of the memory policy (Multi-Conv DAPO): the algorithm as pure torch
functions, its presets, synthetic tasks with verifiable answers, and the learner that trains a
causal LM on a rollout batch's conversations."""
