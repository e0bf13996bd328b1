"""realhf: reinforcement learning for LLM reasoning on a dataflow graph of model function calls."""

__version__ = "0.1.0"
