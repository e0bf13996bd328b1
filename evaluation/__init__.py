"""Offline evaluation of checkpoints on math benchmarks (``eval_and_aggregate.py`` and its helpers).

Modules: ``data_loader`` (datasets + ground truth), ``prompts`` (prompt templates), ``engine``
(generation back-ends: realhf's own engine over worker processes, vLLM), ``metrics`` (pass@k, maj@k),
``runner`` (grading, resumable outputs, aggregation) and the CLI ``eval_and_aggregate``.
"""
