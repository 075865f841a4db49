"""Training: the one loop, its train step, typed state, runtime, checkpoints and process groups.

``loop.train`` is the only training loop. A trainer hands it a step source (what yields each step's
microbatches) and an objective (loss, global normalizer, logged values); everything else here is
shared by every trainer.
"""
