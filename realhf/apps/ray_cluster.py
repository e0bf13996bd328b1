"""``python -m realhf.apps.ray_cluster`` (``scripts/ray_cluster.sh``): start, stop and inspect a Ray cluster on a list
of hosts over SSH (:mod:`realhf.apps.cluster.ray_cluster`)."""
import sys

from realhf.apps.cluster.ray_cluster import main

if __name__ == "__main__":
    sys.exit(main())
