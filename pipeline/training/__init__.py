"""Reinforcement learning of the memory policy (Multi-Conv DAPO): the algorithm as pure torch
functions, its presets, and synthetic tasks with verifiable answers."""
