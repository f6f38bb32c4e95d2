"""Arrival patterns: when each request of a workload is sent, as offsets in seconds from the start of the run."""

from __future__ import annotations

import itertools
import math
import random


def arrival_offsets(count: int, rate: float | None, rng: random.Random) -> list[float]:
    """All at once (``rate`` None or infinite), else a Poisson process at ``rate`` requests per second: the first
    request at 0, then exponential gaps with mean ``1 / rate`` (vLLM's serving benchmark sends, then waits a gap)."""
    if rate is None or math.isinf(rate):
        return [0.0] * count
    if rate <= 0:
        raise ValueError(f"rate must be positive requests per second (or omitted for all at once), got {rate}")
    gaps = [0.0] + [rng.expovariate(rate) for _ in range(count - 1)]
    return list(itertools.accumulate(gaps))[:count]
