"""``infer simulate``: the engine loop, scheduler, allocator, prefix cache and draft acceptance run for real over a
workload; the model's forward is replaced by a cost model that says how long each step takes (no tensors).

- ``cost``: the cost models (``measured``: a fit of this machine's real steps; ``roofline``: an accelerator's peak
  FLOP/s, bandwidth and interconnect over a model geometry) and the fit itself.
- ``engine``: ``SimulatedEngine``, the real ``Engine`` on a simulated clock.
"""
