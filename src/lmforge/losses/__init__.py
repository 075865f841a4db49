"""Loss kernels every objective shares: the chunked cross-entropy and log-prob heads (with their
vocabulary-parallel path), the chunked divergences of distillation, and the typed loss sums
(:class:`~.stats.LossStats`) that a train step accumulates and reduces once."""
