"""Confidence intervals of the acceptance figures we print (issue #35, rule 5: a figure carries its count
and its spread, so a τ of 8 prompts is not read as a τ of 800). One home for offline τ and online accept
length."""

from __future__ import annotations

import random


def ratio_ci95(pairs: list[tuple[float, float]], resamples: int = 2000, seed: int = 0) -> list[float]:
    """A 95 % bootstrap interval of sum(a) / sum(b) over units (prompts), resampling the units: the
    pooled figure's own form (tokens per round, pooled). [x, x] with one unit; seeded, so a report is
    reproducible."""
    rng, n = random.Random(seed), len(pairs)
    if n == 0:
        return [0.0, 0.0]
    values = []
    for _ in range(resamples if n > 1 else 1):
        pick = [pairs[rng.randrange(n)] for _ in range(n)] if n > 1 else pairs
        values.append(sum(a for a, _ in pick) / max(sum(b for _, b in pick), 1))
    values.sort()
    return [values[int(0.025 * (len(values) - 1))], values[int(0.975 * (len(values) - 1))]]
