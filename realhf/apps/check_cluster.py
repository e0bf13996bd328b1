"""``python -m realhf.apps.check_cluster``: what a run will see on its nodes (:mod:`realhf.apps.cluster.check`)."""
from realhf.apps.cluster.check import cli

if __name__ == "__main__":
    cli()
