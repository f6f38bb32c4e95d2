"""Arrival patterns: when each request of a workload is sent, as offsets in seconds from the start of the run."""

from __future__ import annotations

import itertools
import math
import random


def arrival_offsets(count: int, rate: float | None, rng: random.Random, burstiness: float = 1.0) -> list[float]:
    """All at once (``rate`` None or infinite), else ``rate`` requests per second on average: the first request at 0,
    then gamma-distributed gaps with mean ``1 / rate`` and shape ``burstiness`` (vLLM's serving benchmark's factor):
    1 is a Poisson process (exponential gaps), below 1 burstier (clusters and lulls), above 1 more regular."""
    if rate is None or math.isinf(rate):
        return [0.0] * count
    if rate <= 0:
        raise ValueError(f"rate must be positive requests per second (or omitted for all at once), got {rate}")
    if burstiness <= 0:
        raise ValueError(f"burstiness must be positive (1: Poisson; lower: burstier), got {burstiness}")
    if burstiness == 1.0:
        gaps = [0.0] + [rng.expovariate(rate) for _ in range(count - 1)]
    else:
        gaps = [0.0] + [rng.gammavariate(burstiness, 1.0 / (rate * burstiness)) for _ in range(count - 1)]
    return list(itertools.accumulate(gaps))[:count]
