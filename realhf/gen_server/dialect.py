"""How the client (``realhf.gen_server.client``) speaks to one generation server: the server as the client sees
it (:class:`ServerState`), the error naming it (:class:`GenServerError`), and one *dialect* per kind of server with
the same methods — :class:`RealhfDialect` (realhf's own servers: ``gen`` and ``vllm``, ``realhf.gen_server.server``)
and :class:`SGLangDialect` (SGLang's own server program, started by ``realhf.gen_server.sglang``).

SGLang is spoken to in its native endpoints: ``/generate`` (token ids in; output ids, ``output_token_logprobs`` and
``finish_reason`` out; one request per sample, seeded with ``sample_seed(seed, j)`` through ``sampling_seed``),
``/update_weights_from_disk``, ``/pause_generation``, ``/continue_generation``, ``/abort_request``, ``/health``,
``/get_server_info``. SGLang keeps no weight version, so the client stamps every token with the version it last
published to that server (a server updates between requests in the synchronous runs that use this backend).
In-memory weight updates go through SGLang's own ``/init_weights_update_group`` and
``/update_weights_from_distributed``. SGLang authenticates callers with an API key that realhf derives from the run
secret (:func:`api_key_of`).
"""
from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
from typing import List, Optional

from realhf.gen_server.api import GenerateRequest, GenerateResult, SampleOutput, TensorMeta, WeightGroupSpec, sample_seed


class GenServerError(RuntimeError):
    """A generation server failed, answered with an error, or cannot be reached."""

    def __init__(self, server: str, msg: str, status: Optional[int] = None):
        self.server, self.status = server, status
        super().__init__(f"generation server {server}: {msg}")


@dataclasses.dataclass
class ServerState:
    index: int
    address: str  # host:port
    in_flight: int = 0
    tokens_in_flight: int = 0
    failures: int = 0
    down_until: float = 0.0  # monotonic time before which routing avoids it (after a connection failure)
    version: int = 0  # the last version this client set on it

    @property
    def label(self) -> str:
        return f"{self.index} ({self.address})"


class RealhfDialect:
    """realhf's own server protocol (``gen`` and ``vllm`` backends): see ``realhf.gen_server.server``."""

    def __init__(self, client):  # a realhf.gen_server.client.GenClient
        self.c = client

    async def generate(self, s: ServerState, req: GenerateRequest) -> GenerateResult:
        return GenerateResult.from_dict(await self.c.post(s, "/generate", req.to_dict(), self.c.request_timeout))

    async def logprobs(self, s: ServerState, seqs: List[List[int]]) -> List[List[float]]:
        return (await self.c.post(s, "/logprobs", {"sequences": seqs}, self.c.request_timeout))["logprobs"]

    async def update_weights_from_disk(self, s: ServerState, path: str, version: int) -> dict:
        return await self.c.post(s, "/update_weights_from_disk", {"path": path, "version": version},
                                 self.c.weight_timeout)

    async def init_weight_group(self, s: ServerState, spec: WeightGroupSpec) -> dict:
        return await self.c.post(s, "/init_weight_group", dataclasses.asdict(spec), self.c.weight_timeout)

    async def update_weights_from_group(self, s: ServerState, metas: List[TensorMeta], version: int) -> dict:
        return await self.c.post(s, "/update_weights_from_distributed",
                                 {"tensors": [dataclasses.asdict(m) for m in metas], "version": version},
                                 self.c.weight_timeout)

    async def update_weights_from_shared(self, s: ServerState, parts: List[dict], version: int) -> dict:
        return await self.c.post(s, "/update_weights_from_shared", {"parts": parts, "version": version},
                                 self.c.weight_timeout)

    async def pause(self, s: ServerState) -> dict:
        return await self.c.post(s, "/pause", {}, self.c.control_timeout)

    async def resume(self, s: ServerState) -> dict:
        return await self.c.post(s, "/continue", {}, self.c.control_timeout)

    async def abort(self, s: ServerState, rids: Optional[List[str]]) -> int:
        return (await self.c.post(s, "/abort", {"rids": rids}, self.c.control_timeout))["aborted"]

    async def health(self, s: ServerState) -> dict:
        return await self.c.get(s, "/health", self.c.control_timeout)

    async def metrics(self, s: ServerState) -> dict:
        return await self.c.get(s, "/metrics", self.c.control_timeout)



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
