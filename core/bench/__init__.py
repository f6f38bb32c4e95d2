"""Benchmarks: seeded workloads, a runner that replays them against an engine with their arrival times, an HF
transformers baseline, grid ablations over config keys, and the reports (tables, CSV, JSON, plots).

``infer bench`` and ``infer ablate`` (``infer.cli.bench``) are the command-line entry points.
"""
