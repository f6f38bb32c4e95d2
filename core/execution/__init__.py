"""The execution layer: how a step runs through the model, decided in one place.

- ``paths``: the execution paths (fused C stack, fused layers, torch), ``Executor`` choosing among them, and the
  model stack (weights packed, executor, attention backend) the engine and every tensor-parallel rank build.
- ``runner``: ``ModelRunner``, one step's tensors in, the logits out.
- ``calibration``: what this machine measures once (fused-path threshold, large GEMMs, free verification rows).
- ``kv_pool`` and ``memory``: sizing the KV pool from a memory budget and a measured peak.
"""
