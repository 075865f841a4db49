"""Reinforcement learning with verifiable rewards: reward functions, rollouts and the GRPO loss."""
