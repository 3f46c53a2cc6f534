"""Independent seeds derived from a run's seed: one per (round, stream), so that each consumer
(env resets, evaluation, filters, probes) draws from its own stream and resuming at round k
reproduces what an uninterrupted run would have drawn."""

from __future__ import annotations

import numpy as np


def derived_seed(*parts: int) -> int:
    """A 32-bit seed for the tuple ``parts`` (e.g. seed, round, stream):
    ``numpy.random.SeedSequence(parts).generate_state(1)[0]``."""
    return int(np.random.SeedSequence(list(parts)).generate_state(1)[0])
