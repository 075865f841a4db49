"""Loss kernels every objective shares: the one chunked log-prob kernel behind the cross-entropy and
log-prob heads (with its vocabulary-parallel path), the chunked divergences of distillation, and the
typed loss sums (:class:`~.stats.LossStats`) that a train step accumulates and reduces once."""
