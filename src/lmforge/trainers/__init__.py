"""The trainers: pretraining, SFT, GRPO and elastic. Each holds only what its job needs."""
