"""Models of an execution plan's cost, from the model's shape and the layout alone (no weights): ``memory``
estimates what each rank holds and what each model function call adds on top (the launcher's check before start,
the token budgets of ``max_tokens_per_mb=auto``, the per-call estimates in the stats); ``shapes`` (model shapes from
config.json or a table of real models), ``hardware`` (a device's rates: a sourced table of GPUs, or this machine's
profile), ``profile`` (measuring this machine, cached), ``cost`` and ``comm_cost`` (the time of each computation and
transfer of a step under a layout), ``simulate`` (one step of a plan's dataflow graph), ``async_sim`` (the steady state
of asynchronous RL), ``search`` (each MFC's devices, layout and micro-batches chosen on the simulator)."""
