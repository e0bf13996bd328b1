"""The rollout side of an asynchronous run: the rollout manager (``manager``) and its bookkeeping (``ticket_book``),
the rollout workers (``worker``), the engine their workflows generate through (``engine``) and how a launcher starts
them (``launch``)."""
