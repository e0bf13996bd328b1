"""realhf: reinforcement learning for LLM reasoning on a dataflow graph of model function calls.

Its packages form layers that only look down: a module imports its own package and the layers below it, never
one above it nor one beside it (``tests/unit/test_layers.py`` keeps it so). :data:`LAYERS` lists them, lowest first;
packages in one entry sit beside each other. This module itself imports nothing."""

__version__ = "0.1.0"

LAYERS = (
    ("base",),  # logging, name_resolve, network, topology, wire format: imports nothing else of realhf
    ("api",),  # abstractions and configs: what the rest implements
    ("reward", "scheduler"),  # answer grading; launchers
    ("impl",),  # models, datasets, rollout workflows
    ("plan",),  # models of an execution plan's memory and time
    ("gen_server",),  # generation servers and their client
    ("evaluation",),  # evaluation of a checkpoint on math datasets
    ("system",),  # master and model workers, rollout manager and workers
    ("experiments",),  # quickstart experiments as worker configs and a dataflow graph
    ("apps",),  # command lines: quickstart, main, remote
    ("testing",),  # helpers of the tests and benchmarks
)
