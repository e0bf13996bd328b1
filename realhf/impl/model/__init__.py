"""ReaLModel and everything around it: nn, parallelism, conversion from/to HF, backends, interfaces, utils."""
