"""The run secret: 32 random bytes made by the launcher, passed to every process of the run as hex in
``$REALHF_RUN_SECRET``, and the key of every message's HMAC (``realhf.base.wire``). Kept apart from the wire format
so that the launcher makes it without importing torch."""
from __future__ import annotations

import os
import secrets
from typing import Dict, Optional

RUN_SECRET_ENV = "REALHF_RUN_SECRET"
MIN_SECRET_BYTES = 16


def new_run_secret() -> bytes:
    """A fresh random 32-byte secret for one run (the launcher hex-encodes it into the env)."""
    return secrets.token_bytes(32)


def run_secret_from_env(env: Optional[Dict[str, str]] = None) -> bytes:
    """The run secret from ``$REALHF_RUN_SECRET`` (hex); a clear error when missing or malformed."""
    env = os.environ if env is None else env
    value = env.get(RUN_SECRET_ENV)
    if not value:
        raise RuntimeError(
            f"${RUN_SECRET_ENV} is not set: the launcher must pass the run secret (hex) to every worker; "
            f"generate one with realhf.base.run_secret.new_run_secret().hex()"
        )
    try:
        secret = bytes.fromhex(value.strip())
    except ValueError:
        raise RuntimeError(f"${RUN_SECRET_ENV} must be a hex string, got {len(value)} non-hex characters") from None
    _check_secret(secret)
    return secret


def _check_secret(secret: bytes) -> bytes:
    if not isinstance(secret, (bytes, bytearray)):
        raise TypeError(f"run secret must be bytes, got {type(secret).__name__}")
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"run secret must be at least {MIN_SECRET_BYTES} bytes, got {len(secret)}")
    return bytes(secret)
