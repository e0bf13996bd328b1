"""Clients of the rollout manager (``realhf.system.rollout.manager``): every POST signed with the run secret, as
the generation servers' requests are (``realhf.gen_server.auth``).

* :class:`ManagerClient` (asyncio, aiohttp) — rollout workers: ``allocate``, ``finish``, ``server_down``;
* :func:`manager_call` (synchronous, standard library) — the trainer and the master: ``/update_weights``,
  ``/status``.

Errors are :class:`ManagerError` naming the manager's address and the cause (unreachable, an error answer).
"""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any, Optional

from realhf.base.http import error_text
from realhf.gen_server.auth import sign


class ManagerError(RuntimeError):
    def __init__(self, address: str, msg: str, status: Optional[int] = None):
        self.address, self.status = address, status
        super().__init__(f"rollout manager at {address}: {msg}")


def manager_call(address: str, secret: bytes, path: str, body: Optional[dict] = None, timeout: float = 600.0) -> Any:
    """POST ``body`` (signed) to ``path``, or GET it when ``body`` is None; the JSON answer."""
    url = f"http://{address}{path}"
    if body is None:
        req = urllib.request.Request(url, method="GET")
    else:
        data = json.dumps(body).encode()
        req = urllib.request.Request(url, data=data, method="POST",
                                     headers={"Content-Type": "application/json", **sign(secret, "POST", path, data)})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            text = r.read().decode()
    except urllib.error.HTTPError as e:
        raise ManagerError(address, f"{path} answered {e.code}: {error_text(e.read().decode(errors='replace'))}",
                           status=e.code) from None
    except (urllib.error.URLError, OSError) as e:
        raise ManagerError(address, f"{path} failed: cannot reach it ({e}); did it exit? see rollout_manager.log") from None
    return json.loads(text) if text else {}


class ManagerClient:
    def __init__(self, address: str, secret: bytes, timeout: float = 60.0):
        self.address, self.secret, self.timeout = address, secret, timeout
        self._session = None

    async def _post(self, path: str, body: dict) -> Any:
        import aiohttp

        from realhf.base.http import request_json

        if self._session is None:
            self._session = aiohttp.ClientSession()
        data = json.dumps(body).encode()
        headers = {"Content-Type": "application/json", **sign(self.secret, "POST", path, data)}
        return await request_json(self._session, "POST", f"http://{self.address}{path}", path, self.timeout,
                                  lambda msg, status: ManagerError(self.address, msg, status=status), data=data,
                                  headers=headers)

    async def allocate(self, worker: str, wait_s: float = 0.0) -> dict:
        """A ticket for ``worker``; with ``wait_s``, a refusal that a later event may lift is held by the manager
        for up to that many seconds (see ``RolloutManager``)."""
        return await self._post("/allocate", {"worker": worker, **({"wait_s": wait_s} if wait_s else {})})

    async def finish(self, ticket: int, status: str, stats: Optional[dict] = None) -> dict:
        return await self._post("/finish", {"ticket": ticket, "status": status, "stats": stats or {}})

    async def server_down(self, index: int, reason: str) -> dict:
        return await self._post("/server_down", {"index": index, "reason": reason})

    async def close(self):
        if self._session is not None:
            await self._session.close()
            self._session = None
