"""Offline evaluation of checkpoints on math benchmarks (the entry users run is ``evaluation/eval_and_aggregate.py``
of the source tree, whose ``evaluation/data`` holds the datasets).

Modules: ``data_loader`` (datasets + ground truth), ``prompts`` (prompt templates), ``engine``
(generation back-ends: realhf's own engine over worker processes, vLLM), ``metrics`` (pass@k, maj@k),
``runner`` (grading, resumable outputs, aggregation, the command line).
"""
