"""Objectives: what a step optimizes. Each is a loss function, its global normalizer and how the summed
statistics become logged values (:class:`lmforge.training.loop.Objective`).

* :mod:`.next_token`: cross-entropy over target tokens (pretraining, SFT), with
  :mod:`.router`'s mixture-of-experts load-balancing terms.
* :mod:`.grpo`: GRPO's objective with a k3 KL term, GRPO/DAPO/Dr.GRPO aggregation, TIS; its policy
  terms (PPO, GSPO, CISPO) in :mod:`.policy_losses`.
* :mod:`.pairwise`: what the pair losses share; :mod:`.dpo` (DPO / IPO / cDPO, with the RPO NLL term),
  :mod:`.orpo` and :mod:`.simpo` on it; :mod:`.kto` over unpaired examples.
* :mod:`.reward`: a reward model's Bradley-Terry loss.
* :mod:`.distill`: distillation's forward / reverse KL and generalized JSD to a teacher.

A new loss is a module here next to these, used by the recipe that trains with it.
"""
