"""The trainer: the master worker, which runs the dataflow graph from its parts (buffer, executor, hooks, cadence,
dynamic sampling, evaluator), and the model workers (data manager, served generation, memory stats per call)."""
