"""A fleet of generation servers on this machine for tools that are not experiments (evaluation, benchmarks):
``LocalFleet(backend, model, n)`` starts ``n`` server processes with a fresh run secret, waits until they serve
(failing with the server's own log when one exits first), hands out a :class:`SyncGenClient`, and stops them.
Experiments start their servers through their launcher instead (``realhf.gen_server.launch``)."""
from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from typing import List, Optional

from realhf.base.process import tail
from realhf.gen_server.client import GenServerError, SyncGenClient, dialect_options


class LocalFleet:
    def __init__(self, backend: str, model_path: str, n_servers: int = 1, tp: int = 1, dtype: str = "auto",
                 device: str = "auto", max_model_len: int = 2048, max_num_seqs: int = 64, threads: int = 0,
                 extra: Optional[dict] = None, startup_timeout: float = 600.0, log_dir: Optional[str] = None,
                 gpus_per_server: Optional[List[List[int]]] = None):
        from realhf.base.run_secret import new_run_secret

        self.backend, self.n = backend, n_servers
        self.secret = new_run_secret()
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="realhf-fleet-")
        os.makedirs(self.log_dir, exist_ok=True)
        self.procs: List[subprocess.Popen] = []
        self.addresses: List[str] = []
        self._client: Optional[SyncGenClient] = None
        from realhf.gen_server.launch import server_cmd

        try:
            for i in range(n_servers):
                env = dict(os.environ, REALHF_RUN_SECRET=self.secret.hex())
                if threads:
                    env["OMP_NUM_THREADS"] = str(threads)
                if gpus_per_server is not None:
                    env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus_per_server[i])
                addr_file = os.path.join(self.log_dir, f"gen_server_{i}.addr")
                if os.path.exists(addr_file):
                    os.remove(addr_file)
                cmd = server_cmd(backend, model_path, i, dtype, device, tp, max_model_len, max_num_seqs, threads, extra,
                                 "--address-file", addr_file)
                log = open(self.log_path(i), "w")
                self.procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                                   start_new_session=True))
            t0 = time.monotonic()
            for i, p in enumerate(self.procs):
                addr_file = os.path.join(self.log_dir, f"gen_server_{i}.addr")
                while not os.path.exists(addr_file):
                    if p.poll() is not None:
                        raise GenServerError(str(i), f"exited with code {p.returncode} before it served; its log:\n"
                                                     f"{tail(self.log_path(i))}")
                    if time.monotonic() - t0 > startup_timeout:
                        raise GenServerError(str(i), f"did not serve within {startup_timeout:.0f} s; its log:\n"
                                                     f"{tail(self.log_path(i))}")
                    time.sleep(0.1)
                with open(addr_file) as f:
                    self.addresses.append(f.read().strip())
        except BaseException:
            self.stop()
            raise

    def log_path(self, i: int) -> str:
        return os.path.join(self.log_dir, f"gen_server_{i}.log")

    def client(self, **kw) -> SyncGenClient:
        if self._client is None:
            self._client = SyncGenClient(self.addresses, self.secret, **dialect_options(self.backend, self.secret), **kw)
        return self._client

    def stop(self, grace: float = 15.0):
        if self._client is not None:
            self._client.close()
            self._client = None
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        self.procs = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
