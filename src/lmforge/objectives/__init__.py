"""Objectives: what a step optimizes. Each is a loss function, its global normalizer and how the summed
statistics become logged values (:class:`lmforge.training.loop.Objective`).

* :mod:`.next_token`: cross-entropy over target tokens (pretraining, SFT, elastic).
* :mod:`.dpo`: DPO / IPO / cDPO over preference pairs, with the RPO NLL term.
* :mod:`.grpo`: GRPO's clipped surrogate with a k3 KL term, GRPO/DAPO/Dr.GRPO aggregation, TIS.

A new loss (another preference loss, a reward model's) is a module here next to these.
"""
