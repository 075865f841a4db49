"""Reinforcement learning with verifiable rewards: reward functions, rollouts, rollout engines, multi-turn
environments and their tools (the GRPO loss itself is :mod:`lmforge.objectives.grpo`)."""
