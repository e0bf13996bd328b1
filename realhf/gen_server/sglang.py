"""SGLang as a generation backend (GPU only): SGLang's own server program, spoken to in its native endpoints.

``python -m realhf.gen_server.sglang --model ... --index i ...`` (what the launchers start for ``sglang.``
allocations) runs ``python -m sglang.launch_server`` as its child on a free port, waits until it serves, then
registers ``host:port`` in name_resolve like realhf's own servers, and ends with its child (and the child
with it). SGLang authenticates callers with an API key; realhf derives it from the run secret
(:func:`api_key_of`), so only the run's processes can generate, update weights, pause or abort.

How the client speaks to it: ``realhf.gen_server.dialect.SGLangDialect``.

Nothing here has run yet: SGLang needs a CUDA GPU and none was available to this project (its tests are
marked ``gpu``).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from realhf.base import logging
from realhf.gen_server.dialect import api_key_of

logger = logging.getLogger("realhf.gen_server.sglang")


def main(argv=None) -> int:
    """Run SGLang's server for one generation-server slot of a run and register it (see the module docstring)."""
    from realhf.base import name_resolve, network
    from realhf.base.name_resolve import names
    from realhf.base.process import exit_when_parent_dies
    from realhf.base.run_secret import run_secret_from_env
    from realhf.gen_server.server import parse_args

    a = parse_args(argv)
    exit_when_parent_dies()
    secret = run_secret_from_env()
    host = a.host or network.worker_host()
    port = a.port or network.find_free_port(host)
    dtype = "bfloat16" if a.dtype == "auto" else a.dtype
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", a.model, "--host", host, "--port", str(port),
           "--tp-size", str(a.tp), "--dtype", dtype, "--context-length", str(a.max_model_len),
           "--max-running-requests", str(a.max_num_seqs), "--random-seed", str(a.seed),
           "--api-key", api_key_of(secret), "--skip-server-warmup"]
    import json

    for k, v in json.loads(a.extra).items():  # backend options: --<key> <value> (true: a bare flag)
        flag = "--" + k.replace("_", "-")
        cmd += [flag] if v is True else ([] if v is False else [flag, str(v)])
    proc = subprocess.Popen(cmd, start_new_session=True)
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, lambda *_: (os.killpg(proc.pid, signal.SIGTERM), sys.exit(0)))
    import urllib.request

    req = urllib.request.Request(f"http://{host}:{port}/health", headers={"Authorization": f"Bearer {api_key_of(secret)}"})
    while proc.poll() is None:
        try:
            with urllib.request.urlopen(req, timeout=5) as r:
                if r.status == 200:
                    break
        except OSError:
            time.sleep(1.0)
    if proc.poll() is not None:
        logger.error("SGLang server for slot %d exited with code %s before it served", a.index, proc.returncode)
        return proc.returncode or 1
    if a.name_resolve_root and a.exp and a.trial:
        nr = name_resolve.make_repository("file", root=a.name_resolve_root)
        nr.add(names.gen_server(a.exp, a.trial, a.index), f"{host}:{port}", replace=True)
    logger.info("SGLang generation server %d serving on http://%s:%d", a.index, host, port)
    return proc.wait()


if __name__ == "__main__":
    sys.exit(main())
