"""``infer serve``: an OpenAI-compatible HTTP server driving the same ``Engine.step()`` as offline generation.

- ``protocol``: request and response bodies in OpenAI's shapes, and how a request becomes ``SamplingParams``.
- ``engine_loop``: the engine thread beside the asyncio event loop (the only code that touches the engine).
- ``updates``: what the engine thread sends back per request each step (text deltas, logprobs, usage).
- ``responses``: updates turned into OpenAI completion / chat bodies and stream chunks.
- ``delivery``: server-sent events or one JSON body, aborting the request when its client leaves.
- ``errors``: OpenAI's error body and the exception handlers that produce it.
- ``metrics``: Prometheus text for ``GET /metrics``.
- ``app``: the FastAPI routes; ``cli``: the ``infer serve`` command (uvicorn, graceful shutdown).
- ``process``: a server in a child process on a free loopback port (tests, benchmarks).
- ``stress``: a bounded hostile load against a live server (``python -m infer.serve.stress``).

Kept free of imports so that ``infer --help`` does not load FastAPI.
"""
