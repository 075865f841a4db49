"""Training: the one loop, its train step, its state, stop signals and checkpointing (the runtime it
runs on is :mod:`lmforge.runtime`).

``loop.train`` is the only training loop. A recipe (:mod:`lmforge.recipes`) hands it a step source
(what yields each step's microbatches) and an objective (:mod:`lmforge.objectives`: loss, global
normalizer, logged values); everything else here is shared by every recipe.
"""
