#!/usr/bin/env bash
# Start, check, inspect and stop a Ray cluster on a list of hosts over SSH (realhf/apps/cluster/ray_cluster.py):
#
#   scripts/ray_cluster.sh start  --head node01 --workers node02,node03 [--port 6379] [--num-gpus 8] \
#                                 [--ssh "ssh -o BatchMode=yes"] [--python /path/to/python] [--fileroot /shared/dir]
#   scripts/ray_cluster.sh status --head node01 --workers node02,node03 [--port 6379]
#   scripts/ray_cluster.sh stop   --head node01 --workers node02,node03 [--port 6379] [--all]
#
# `start` ends with `python -m realhf.apps.check_cluster --mode ray` against the new cluster and exits with its code.
# `stop` stops only this cluster's Ray processes (those of its GCS port); `--all` runs plain `ray stop` on each host.
# The local Python is $PYTHON (default python3); every host runs --python (default: the same path). --help for more.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" -m realhf.apps.ray_cluster "$@"
