"""Tensor and pipeline parallelism of ReaLModel, and parameter reallocation between layouts."""
