"""The algorithm as plain functions: advantages (GAE), losses, KL control, masked statistics."""
