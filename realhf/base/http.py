"""JSON over HTTP, one way for every client of the run's HTTP services (generation servers, the rollout manager):
``request_json`` sends one request with aiohttp and returns the parsed answer, or raises the caller's own error
(``fail(message, status)``; status None when the service could not be reached or timed out)."""
from __future__ import annotations

import asyncio
import json
from typing import Any, Callable, Optional


def error_text(text: str) -> str:
    """The ``error`` field of a JSON error answer, else the start of the text."""
    try:
        return json.loads(text).get("error", text)
    except (ValueError, AttributeError):
        return text[:500]


async def request_json(session, method: str, url: str, path: str, timeout: float,
                       fail: Callable[[str, Optional[int]], Exception], **kw) -> Any:
    import aiohttp

    try:
        async with session.request(method, url, timeout=aiohttp.ClientTimeout(total=timeout), **kw) as r:
            text = await r.text()
            if r.status != 200:
                raise fail(f"{path} answered {r.status}: {error_text(text)}", r.status)
            return json.loads(text) if text else {}
    except asyncio.TimeoutError:
        raise fail(f"{path} timed out after {timeout:.0f} s", None) from None
    except aiohttp.ClientError as e:
        raise fail(f"{path} failed: cannot reach it ({type(e).__name__}: {e})", None) from None
