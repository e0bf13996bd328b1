"""The runtime, in three parts that only look down (``LAYERS``, kept by ``tests/unit/test_layers.py``):

* ``transport`` — what crosses processes: the request/reply stream between the master and the model workers (ZMQ,
  signed), heartbeats, the stream of finished trajectories, the rollout manager's clients, the run's notices;
* ``trainer`` — the master worker and its parts (buffer, executor, hooks, cadence, evaluator) and the model
  workers (data manager, served generation, memory stats);
* ``rollout`` — the asynchronous rollout side: the rollout manager and its ticket book, the rollout workers, the
  engine workflows generate through, and how a launcher starts them.

The trainer and the rollout side sit beside each other and meet only through ``transport``. Import the
submodules directly; this package imports nothing eagerly."""

LAYERS = (
    ("transport",),  # request/reply stream, heartbeats, trajectory stream, manager clients, notices
    ("trainer", "rollout"),  # master and model workers; rollout manager, rollout workers and their engine
)
