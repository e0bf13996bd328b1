"""SGLang as a generation backend (GPU only): SGLang's own server program, spoken to in its native endpoints.

``python -m realhf.gen_server.sglang --model ... --index i ...`` (what the launchers start for ``sglang.``
allocations) runs ``python -m sglang.launch_server`` as its child on a free port, waits until it serves, then
registers ``host:port`` in name_resolve like realhf's own servers, and ends with its child (and the child
with it). SGLang authenticates callers with an API key; realhf derives it from the run secret
(:func:`api_key_of`), so only the run's processes can generate, update weights, pause or abort.

:class:`SGLangDialect` maps the client's calls onto SGLang's endpoints: ``/generate`` (token ids in; output ids,
``output_token_logprobs`` and ``finish_reason`` out; one request per sample, seeded with
``sample_seed(seed, j)`` through ``sampling_seed``), ``/update_weights_from_disk``, ``/pause_generation``,
``/continue_generation``, ``/abort_request``, ``/health``, ``/get_server_info``. SGLang keeps no weight
version, so the client stamps every token with the version it last published to that server (a server
updates between requests in the synchronous runs that use this backend). In-memory weight updates go
through SGLang's own ``/init_weights_update_group`` and ``/update_weights_from_distributed``.

Nothing here has run yet: SGLang needs a CUDA GPU and none was available to this project (its tests are
marked ``gpu``).
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import signal
import subprocess
import sys
import time
from typing import List, Optional

from realhf.base import logging
from realhf.gen_server.api import GenerateRequest, GenerateResult, SampleOutput, TensorMeta, WeightGroupSpec, sample_seed

logger = logging.getLogger("realhf.gen_server.sglang")


def api_key_of(secret: bytes) -> str:
    """The SGLang API key of a run: derived from its secret (never the secret itself)."""
    return hmac.new(secret, b"realhf-sglang-api-key", hashlib.sha256).hexdigest()


def _finish(meta: dict) -> str:
    fr = meta.get("finish_reason")
    t = fr.get("type") if isinstance(fr, dict) else fr
    return t if t in ("stop", "length", "abort") else ("abort" if t else "length")


class SGLangDialect:
    def __init__(self, client, api_key: Optional[str] = None):
        self.c = client
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def _post(self, s, path, data, timeout):
        res = await self.c.post(s, path, data, timeout, signed=False, headers=self.headers)
        if isinstance(res, dict) and res.get("success") is False:
            from realhf.gen_server.client import GenServerError

            raise GenServerError(s.label, f"{path} failed: {res.get('message')}", status=500)
        return res

    async def generate(self, s, req: GenerateRequest) -> GenerateResult:
        sp = req.sampling

        async def one(j: int) -> SampleOutput:
            params = {"max_new_tokens": sp.max_new_tokens, "min_new_tokens": sp.min_new_tokens,
                      "temperature": 0.0 if sp.greedy else sp.temperature, "top_p": 1.0 if sp.greedy else sp.top_p,
                      "top_k": sp.top_k if sp.top_k else -1, "stop_token_ids": sp.stop_token_ids, "ignore_eos": True,
                      "skip_special_tokens": False}
            if sp.seed is not None and not sp.greedy:
                params["sampling_seed"] = sample_seed(sp.seed, j)
            out = await self._post(s, "/generate", {"input_ids": req.input_ids, "sampling_params": params,
                                                    "return_logprob": True, "rid": f"{req.rid}-{j}"},
                                   self.c.request_timeout)
            meta = out.get("meta_info", {})
            lps = [float(x[0]) for x in meta.get("output_token_logprobs", [])]
            ids = list(out.get("output_ids") or [int(x[1]) for x in meta.get("output_token_logprobs", [])])
            return SampleOutput(output_ids=ids, logprobs=lps, versions=[s.version] * len(ids),
                                finish_reason=_finish(meta))

        return GenerateResult(rid=req.rid, outputs=list(await asyncio.gather(*(one(j) for j in range(sp.n)))))

    async def logprobs(self, s, seqs: List[List[int]]) -> List[List[float]]:
        res = []
        for seq in seqs:
            out = await self._post(s, "/generate", {"input_ids": seq, "sampling_params": {"max_new_tokens": 1,
                                                                                          "temperature": 0.0},
                                                    "return_logprob": True, "logprob_start_len": 0},
                                   self.c.request_timeout)
            res.append([float(x[0]) for x in out["meta_info"]["input_token_logprobs"][1:]])
        return res

    async def update_weights_from_disk(self, s, path: str, version: int) -> dict:
        return await self._post(s, "/update_weights_from_disk", {"model_path": path}, self.c.weight_timeout)

    async def init_weight_group(self, s, spec: WeightGroupSpec) -> dict:
        return await self._post(s, "/init_weights_update_group", {
            "master_address": spec.master_addr, "master_port": spec.master_port, "rank_offset": spec.rank_offset,
            "world_size": spec.world_size, "group_name": spec.group_name, "backend": spec.backend},
            self.c.weight_timeout)

    async def update_weights_from_group(self, s, metas: List[TensorMeta], version: int) -> dict:
        if any(m.src != 0 for m in metas):
            raise ValueError("SGLang receives every tensor from rank 0 of the weight group; publish from one trainer "
                             "rank (pp=1) or use param_realloc=disk")
        return await self._post(s, "/update_weights_from_distributed", {
            "names": [m.name for m in metas], "dtypes": [m.dtype for m in metas], "shapes": [m.shape for m in metas],
            "flush_cache": True}, self.c.weight_timeout)

    async def pause(self, s) -> dict:
        return await self._post(s, "/pause_generation", {}, self.c.control_timeout)

    async def resume(self, s) -> dict:
        return await self._post(s, "/continue_generation", {}, self.c.control_timeout)

    async def abort(self, s, rids) -> int:
        if rids is None:
            await self._post(s, "/abort_request", {"abort_all": True}, self.c.control_timeout)
            return -1
        for r in rids:
            await self._post(s, "/abort_request", {"rid": r}, self.c.control_timeout)
        return len(rids)

    async def health(self, s) -> dict:
        await self.c.get(s, "/health", self.c.control_timeout, headers=self.headers)
        return {"status": "ok", "version": s.version}

    async def metrics(self, s) -> dict:
        info = await self.c.get(s, "/get_server_info", self.c.control_timeout, headers=self.headers)
        return {"backend": "sglang", "version": s.version, "server_info": info}


def main(argv=None) -> int:
    """Run SGLang's server for one generation-server slot of a run and register it (see the module docstring)."""
    from realhf.base import name_resolve, network
    from realhf.base.name_resolve import names
    from realhf.base.process import exit_when_parent_dies
    from realhf.gen_server.server import parse_args
    from realhf.system.request_reply_stream import run_secret_from_env

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
