"""Bounds on what a cluster is asked for: a Ray address (HOST:PORT or 'auto'), a TCP port, a node count. They are
checked where a recipe is validated and where a command line gives one, so that a bad value is refused before
anything waits on it or asks SLURM for it."""

from __future__ import annotations

import unicodedata

from gymv.errors import GymvError

MIN_PORT, MAX_PORT = 1, 65535
# Ray's scalability envelope is about 2,000 nodes; twice that still fits any cluster gymv could join, and
# stops a typo (1000000000) before it becomes a SLURM request or a wait for nodes that never come
MAX_NODES = 4096
ADDRESS_FIX = "use HOST:PORT with a port from 1 to 65535, e.g. 127.0.0.1:6379, or 'auto'"


def port_problem(port: object) -> str | None:
    """What is wrong with `port` as a TCP port, or None."""
    if isinstance(port, bool) or not isinstance(port, int):
        return f"{port!r} is not a whole number"
    if not MIN_PORT <= port <= MAX_PORT:
        return f"{port} is not a TCP port (from {MIN_PORT} to {MAX_PORT})"
    return None


def check_port(port: object, where: str) -> int:
    problem = port_problem(port)
    if problem:
        raise GymvError(f"the port {problem}", where=where, fix=f"give a port from {MIN_PORT} to {MAX_PORT}, e.g. 6379")
    return port  # type: ignore[return-value]


def has_control_or_space(text: str) -> bool:
    """Whether `text` holds whitespace or an unprintable character (a line break, a tab, a format mark)."""
    return any(ch.isspace() or unicodedata.category(ch)[0] in "CZ" for ch in text)


def one_line(text: str) -> str:
    """`text` as it may stand in a one-line message: as it is if printable, else quoted with its escapes."""
    return text if text.isprintable() else repr(text)


def address_problem(address: str) -> str | None:
    """What is wrong with `address` as a Ray address gymv joins, or None ('auto' is Ray's own lookup)."""
    if address == "auto":
        return None
    host, sep, port = address.rpartition(":")
    if not sep or not host:
        return f"{address!r} is not HOST:PORT"
    if has_control_or_space(host) or "/" in host:
        return f"{address!r} has no plain host name before its port (Ray Client ray:// addresses are not joined)"
    if not port.isascii() or not port.isdigit():
        return f"{address!r} has no port number after its host"
    return port_problem(int(port))


def split_address(address: str, where: str) -> tuple[str, int]:
    """(host, port) of a HOST:PORT address; a GymvError naming `where` otherwise."""
    problem = address_problem(address)
    if problem or address == "auto":
        raise GymvError(f"bad Ray address: {problem or repr(address)}", where=where, fix=ADDRESS_FIX)
    host, _, port = address.rpartition(":")
    if host.startswith("[") and host.endswith("]"):  # an IPv6 address, [::1]:6379
        host = host[1:-1]
    return host, int(port)
