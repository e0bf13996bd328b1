"""Cluster tools: ``check`` (with ``probe``, ``collect``, ``report``) checks what a run will see on its nodes before
it is submitted (``python -m realhf.apps.check_cluster``); ``ray_cluster`` starts, stops and inspects a Ray cluster
on a list of hosts over SSH (``scripts/ray_cluster.sh``, ``python -m realhf.apps.ray_cluster``)."""
