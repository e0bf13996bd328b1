"""Small network helpers: free ports, this machine's IP, loopback checks."""
from __future__ import annotations

import ipaddress
import os
import socket
from typing import List

from realhf.base import logging

logger = logging.getLogger(__name__)


def find_free_ports(n: int, host: str = "127.0.0.1") -> List[int]:
    """``n`` distinct TCP ports that were free on ``host`` a moment ago.

    All sockets are held open until every port is picked, so the ports are distinct; another
    process may still take one before the caller binds it (bind to port 0 where you can).
    """
    if n < 0:
        raise ValueError(f"find_free_ports: n must be >= 0, got {n}")
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def find_free_port(host: str = "127.0.0.1") -> int:
    """One TCP port that was free on ``host`` a moment ago."""
    return find_free_ports(1, host)[0]


def gethostip() -> str:
    """This machine's outward-facing IPv4 address, or ``127.0.0.1`` when it has none.

    Tries the address of the interface the default route would use (a UDP ``connect`` sends no
    packet), then the address the host name resolves to.
    """
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))
            ip = s.getsockname()[0]
            if ip and not ip.startswith("0."):
                return ip
    except OSError:
        pass
    try:
        ip = socket.gethostbyname(socket.gethostname())
        if ip and not ip.startswith("0."):
            return ip
    except OSError:
        pass
    logger.debug("gethostip: no outward-facing address found, using 127.0.0.1")
    return "127.0.0.1"


def is_loopback(host: str) -> bool:
    """True for ``localhost``, 127.0.0.0/8, ``::1``, and host names that resolve to them."""
    h = host.strip().strip("[]")
    if h.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        pass
    try:
        return ipaddress.ip_address(socket.gethostbyname(h)).is_loopback
    except (OSError, ValueError):
        return False


def worker_host() -> str:
    """The address this process binds and advertises for its sockets and rendezvous: ``$REALHF_HOST`` when
    a multi-node launcher set it (the node's IP), else ``127.0.0.1`` (every process on one machine)."""
    return os.environ.get("REALHF_HOST") or "127.0.0.1"
