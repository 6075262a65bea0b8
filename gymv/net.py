"""Who may talk to gymv's local servers: the Host and Origin rules of its HTTP servers, and rendezvous stores
that listen on one address only.

A server bound to a loopback address is reachable from this machine's browsers too. A web page cannot read
its answers, but it can send it requests: by rebinding its own host name to 127.0.0.1 (caught by the Host
check) or by a cross-origin "simple" POST (caught by the Origin check and by requiring a JSON content type,
which a browser can only send after a CORS preflight that these servers never approve).
"""

from __future__ import annotations

import ipaddress

LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1")


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def host_name(header: str) -> str:
    """The name in a Host header ('[::1]:8000' -> '::1', 'localhost:80' -> 'localhost')."""
    if header.startswith("["):
        return header[1:header.find("]")]
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def host_allowed(bind_host: str, header: str | None) -> bool:
    """On a loopback bind, only loopback names (or no Host at all, as HTTP/1.0 clients send)."""
    if not is_loopback(bind_host) or not header:
        return True
    return host_name(header) in LOOPBACK_NAMES or is_loopback(host_name(header))


def origin_allowed(bind_host: str, origin: str | None) -> bool:
    """Requests from a browser page carry Origin; only pages served from loopback may call a loopback server."""
    if not origin or not is_loopback(bind_host):
        return True
    from urllib.parse import urlparse

    name = urlparse(origin).hostname or ""
    return name in LOOPBACK_NAMES or is_loopback(name)


def master_store(host: str, world_size: int):
    """(a TCPStore server listening on `host` only, its socket): torch's own server listens on every
    interface whatever host it is given, so it is handed a socket bound here. The store owns that socket's
    descriptor from then on and closes it when it goes, so the socket returned is detached (closing it does
    nothing): closed twice, the descriptor's number, by then another file's or socket's, would be closed
    under its new owner."""
    import socket

    from torch.distributed import TCPStore

    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.bind((host, 0))
        sock.listen()
        store = TCPStore(host, sock.getsockname()[1], world_size=world_size, is_master=True, wait_for_workers=False,
                         master_listen_fd=sock.fileno())
    except BaseException:
        sock.close()
        raise
    sock.detach()
    return store, sock
