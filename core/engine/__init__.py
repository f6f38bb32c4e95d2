"""The engine layer: the step loop (``engine``), speculative decoding's verification (``spec_decode``), sampling
(``sampler``), detokenization, metrics, and rank 0's side of tensor parallelism (``tensor_parallel``).

``from infer.engine import Engine`` is the public path to the engine (``infer.LLM`` wraps it).
"""

from infer.engine.engine import Engine, EngineStats, RequestError, StepStats

__all__ = ["Engine", "EngineStats", "RequestError", "StepStats"]
