"""Optimizers and their schedule: AdamW (:mod:`.adamw`), 8-bit AdamW and Muon (:mod:`.optimizers`),
the learning-rate schedule (:mod:`.schedule`)."""
