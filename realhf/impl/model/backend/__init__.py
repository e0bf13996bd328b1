"""Inference and training engines over a ReaLModel shard, and the optimizer."""
