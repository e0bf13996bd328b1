"""The generation server: one HTTP/JSON server around one :class:`~realhf.gen_server.api.GenerationEngine`.

``python -m realhf.gen_server.server --backend gen|vllm --model <hf folder> [--index i --exp E --trial T
--name-resolve-root DIR]``; the run secret comes from ``$REALHF_RUN_SECRET`` (hex), as for every realhf process.

Endpoints (POST bodies and answers are JSON; every POST must be signed, see ``realhf.gen_server.auth``):

==================================  ==============================================================================
``GET /health``                     ``{"status": "ok", "backend", "version", "index", "pid", "stalled_s", "host",
                                    "gpus", "shared_weights"}`` (no secret; ``host``, ``gpus``: where weights can be
                                    shared with it, :mod:`realhf.gen_server.weight_share`)
``GET /metrics``                    running/waiting requests, tokens in flight, version, generated tokens, paused
``POST /generate``                  ``{"rid", "input_ids", "sampling": {...}}`` -> ``{"rid", "outputs": [...]}``
``POST /logprobs``                  ``{"sequences": [[ids]]}`` -> ``{"logprobs": [[...]]}``
``POST /abort``                     ``{"rids": [...] | null}`` -> ``{"aborted": k}``
``POST /pause``, ``/continue``      stop / resume progress on requests
``POST /update_weights_from_disk``  ``{"path", "version"}``
``POST /init_weight_group``         a :class:`~realhf.gen_server.api.WeightGroupSpec` as JSON
``POST /update_weights_from_distributed``  ``{"tensors": [TensorMeta...], "version"}``
``POST /update_weights_from_shared``  ``{"parts": [...], "version"}``: tensors the trainer shares on this host
                                    (``realhf.gen_server.weight_share``)
==================================  ==============================================================================

Errors: 400 with ``{"error": ...}`` for a malformed request, 401 for an unsigned, forged or replayed one, 500
with the cause when the engine fails. The server binds ``$REALHF_HOST`` or loopback (``--host`` overrides:
a cluster launcher sets it), registers ``host:port`` in name_resolve only once the engine has loaded (so a
registered server is a ready one), and exits when its parent (the launcher) is gone.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
import traceback
from typing import Any, Awaitable, Callable, Dict, Optional

from realhf.base import failpoint, logging
from realhf.gen_server.api import (EngineConfig, GenerateRequest, GenerationEngine, RequestError, TensorMeta,
                                   WeightGroupSpec)
from realhf.gen_server.auth import RequestVerifier
from realhf.gen_server.weight_share import host_id, visible_gpus
from realhf.base.wire import MAX_FRAME_BYTES, RejectionLog

logger = logging.getLogger("realhf.gen_server")


def _fields(cls, d: Any, what: str) -> dict:
    import dataclasses

    if not isinstance(d, dict):
        raise RequestError(f"{what} must be a JSON object")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise RequestError(f"unknown {what} keys {unknown}; allowed: {sorted(names)}")
    return d


def _version(v: Any) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise RequestError(f"version must be an integer >= 0, got {v!r}")
    return v


class GenServer:
    """The aiohttp application around ``engine``; ``start(host, port)`` serves and returns the bound port."""

    def __init__(self, engine: GenerationEngine, secret: bytes, index: int = 0):
        self.engine, self.index = engine, index
        self.verifier = RequestVerifier(secret)
        self.rejections = RejectionLog(f"generation server {index}")
        self.runner = None
        self.port: Optional[int] = None
        self.started_at = time.time()

    def app(self):
        from aiohttp import web

        app = web.Application(client_max_size=MAX_FRAME_BYTES)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        routes: Dict[str, Callable[[dict], Awaitable[dict]]] = {
            "/generate": self._generate, "/logprobs": self._logprobs, "/abort": self._abort, "/pause": self._pause,
            "/continue": self._continue, "/update_weights_from_disk": self._update_disk,
            "/init_weight_group": self._init_group, "/update_weights_from_distributed": self._update_group,
            "/update_weights_from_shared": self._update_shared,
        }
        for path, fn in routes.items():
            app.router.add_post(path, self._signed(path, fn))
        return app

    def _signed(self, path: str, fn):
        from realhf.gen_server.auth import signed_route

        # malformed input is the caller's fault (400, named for the caller); an engine failure answers 500
        return signed_route(self.verifier, self.rejections, path, fn, (RequestError, ValueError, KeyError, TypeError),
                            logger)

    async def _health(self, request):
        """Liveness (``realhf.gen_server.liveness``): answered by the event loop, with ``stalled_s``, the seconds the
        engine has had requests without producing a token (0 while it progresses or is idle)."""
        from aiohttp import web

        from realhf.gen_server.liveness import EngineProgress

        progress = self.__dict__.setdefault("_progress", EngineProgress())
        stalled = progress.observe(self.engine.metrics())
        return web.json_response({"status": "ok", "backend": self.engine.backend, "version": self.engine.version,
                                  "index": self.index, "pid": os.getpid(), "stalled_s": round(stalled, 1),
                                  "host": host_id(), "gpus": visible_gpus(),
                                  "shared_weights": bool(self.engine.shared_weights)})

    async def _metrics(self, request):
        from aiohttp import web

        m = dict(self.engine.metrics())
        m.update(backend=self.engine.backend, index=self.index, uptime_s=round(time.time() - self.started_at, 1),
                 rejected_requests=self.rejections.count)
        return web.json_response(m)

    async def _generate(self, d):
        req = GenerateRequest.from_dict(d)
        lag = failpoint.delay_secs("gen_server.generate")  # tests: a random delay ($REALHF_DELAYS)
        if lag:
            await asyncio.sleep(lag)
        return (await self.engine.generate(req)).to_dict()

    async def _logprobs(self, d):
        seqs = d.get("sequences") if isinstance(d, dict) else None
        if not isinstance(seqs, list) or not seqs or not all(
                isinstance(s, list) and len(s) >= 2 and all(isinstance(x, int) for x in s) for s in seqs):
            raise RequestError("sequences must be a non-empty list of token-id lists of length >= 2")
        return {"logprobs": await self.engine.logprobs(seqs)}

    async def _abort(self, d):
        rids = d.get("rids") if isinstance(d, dict) else None
        if rids is not None and (not isinstance(rids, list) or not all(isinstance(r, str) for r in rids)):
            raise RequestError("rids must be a list of request ids or null (all)")
        return {"aborted": await self.engine.abort(rids)}

    async def _pause(self, d):
        await self.engine.pause()
        return {"paused": True}

    async def _continue(self, d):
        await self.engine.resume()
        return {"paused": False}

    async def _update_disk(self, d):
        path = d.get("path") if isinstance(d, dict) else None
        if not isinstance(path, str) or not os.path.isdir(path):
            raise RequestError(f"path must name an existing folder on the server's machine, got {path!r}")
        version = _version(d.get("version"))
        t0 = time.perf_counter()
        await self.engine.update_weights_from_disk(path, version)
        return {"version": self.engine.version, "seconds": time.perf_counter() - t0}

    async def _init_group(self, d):
        spec = WeightGroupSpec(**_fields(WeightGroupSpec, d, "weight group"))
        await self.engine.init_weight_group(spec)
        return {"ok": True}

    async def _update_group(self, d):
        if not isinstance(d, dict) or not isinstance(d.get("tensors"), list):
            raise RequestError("the body must hold 'tensors': a list of {name, dtype, shape, src}")
        metas = [TensorMeta(**_fields(TensorMeta, m, "tensor")) for m in d["tensors"]]
        version = _version(d.get("version"))
        t0 = time.perf_counter()
        await self.engine.update_weights_from_group(metas, version)
        return {"version": self.engine.version, "seconds": time.perf_counter() - t0}

    async def _update_shared(self, d):
        if not isinstance(d, dict) or not isinstance(d.get("parts"), list):
            raise RequestError("the body must hold 'parts': a list of shared-weight parts")
        version = _version(d.get("version"))
        t0 = time.perf_counter()
        await self.engine.update_weights_from_shared(d["parts"], version)
        return {"version": self.engine.version, "seconds": time.perf_counter() - t0}

    async def start(self, host: str, port: int) -> int:
        from realhf.gen_server.auth import serve_app

        self.runner, self.port = await serve_app(self.app(), host, port, f"generation server {self.index}")
        return self.port

    async def stop(self):
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description="realhf generation server")
    ap.add_argument("--backend", required=True, help="gen | vllm")
    ap.add_argument("--model", required=True, help="Hugging Face model folder")
    ap.add_argument("--dtype", default="auto", help="float32 | bfloat16 | float16 | auto (bf16 on GPU, fp32 on CPU)")
    ap.add_argument("--device", default="auto", help="cpu | cuda | auto")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--extra", default="{}", help="backend options as a JSON object")
    ap.add_argument("--host", default=None, help="address to bind (default: $REALHF_HOST or 127.0.0.1)")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--index", type=int, default=0)
    ap.add_argument("--exp", default=None)
    ap.add_argument("--trial", default=None)
    ap.add_argument("--name-resolve-root", default=None)
    ap.add_argument("--address-file", default=None, help="also write host:port here once serving")
    return ap.parse_args(argv)


async def serve(a) -> int:
    from realhf.base import network
    from realhf.gen_server import make_engine
    from realhf.base.run_secret import run_secret_from_env

    secret = run_secret_from_env()
    try:
        extra = json.loads(a.extra)
        assert isinstance(extra, dict)
    except (ValueError, AssertionError):
        raise SystemExit(f"--extra must be a JSON object, got {a.extra!r}")
    device, dtype = a.device, a.dtype
    if device == "auto" or dtype == "auto":
        import torch

        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if dtype == "auto":  # the runtime's default: bf16 on GPU, fp32 on CPU
            dtype = "bfloat16" if device == "cuda" else "float32"
    cfg = EngineConfig(backend=a.backend, model_path=a.model, dtype=dtype, device=device, tp_size=a.tp,
                       max_model_len=a.max_model_len, max_num_seqs=a.max_num_seqs, seed=a.seed, threads=a.threads,
                       extra=extra)
    host = a.host or network.worker_host()
    engine = make_engine(cfg)
    t0 = time.perf_counter()
    await engine.start()
    logger.info("generation server %d: %s engine loaded %s on %s in %s in %.1f s", a.index, a.backend, a.model,
                device, dtype, time.perf_counter() - t0)
    server = GenServer(engine, secret, a.index)
    port = await server.start(host, a.port)
    addr = f"{host}:{port}"
    if a.name_resolve_root and a.exp and a.trial:
        from realhf.base import name_resolve
        from realhf.base.name_resolve import names

        nr = name_resolve.make_repository("file", root=a.name_resolve_root)
        nr.add(names.gen_server(a.exp, a.trial, a.index), addr, replace=True)
    if a.address_file:
        tmp = a.address_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(addr)
        os.replace(tmp, a.address_file)
    logger.info("generation server %d (%s) serving on http://%s", a.index, a.backend, addr)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        loop.add_signal_handler(s, stop.set)
    await stop.wait()
    logger.info("generation server %d stopping", a.index)
    await server.stop()
    await engine.close()
    return 0


def main(argv=None) -> int:
    a = parse_args(argv)
    from realhf.base.process import exit_when_parent_dies

    exit_when_parent_dies()
    from realhf.base.host_memory import retain_freed_memory

    retain_freed_memory()
    try:
        return asyncio.run(serve(a))
    except SystemExit:
        raise
    except BaseException as e:  # the cause, first, for the launcher's report
        logger.error("generation server %d (%s, model %s) failed: %s: %s", a.index, a.backend, a.model,
                     type(e).__name__, e)
        traceback.print_exc()
        return 1


if __name__ == "__main__":
    sys.exit(main())
