"""What crosses the processes of a run: the master's request/reply stream to the model workers and their heartbeats,
the trajectory stream from rollout workers to trainer heads, the clients of the rollout manager, and the notices every
process posts for the console. Imports nothing of the trainer or the rollout side."""
