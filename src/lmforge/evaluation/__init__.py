"""Evaluation during and after training: token-weighted eval loss and held-out task exact match."""
