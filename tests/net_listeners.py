"""TCP listening sockets of a process tree, read from /proc (Linux), for tests of what a run exposes."""

from __future__ import annotations

import ipaddress
import os
import socket
import struct


def _address(hexaddr: str) -> tuple[str, int]:
    ip, port = hexaddr.split(":")
    raw = bytes.fromhex(ip)
    words = struct.unpack(f"<{len(raw) // 4}I", raw)  # /proc prints each 32-bit word in host (little-endian) order
    packed = struct.pack(f">{len(words)}I", *words)
    family = socket.AF_INET if len(raw) == 4 else socket.AF_INET6
    return socket.inet_ntop(family, packed), int(port, 16)


def _listening_inodes() -> dict[str, tuple[str, int]]:
    out = {}
    for table in ("tcp", "tcp6"):
        try:
            lines = open(f"/proc/net/{table}").read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] == "0A":  # TCP_LISTEN
                out[f[9]] = _address(f[1])
    return out


def descendants(root: int) -> set[int]:
    """root and every process below it."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = open(f"/proc/{name}/stat").read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(name))
    out, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid not in out:
            out.add(pid)
            todo += children.get(pid, [])
    return out


def listeners(pids: set[int]) -> list[tuple[int, str, int]]:
    """(pid, address, port) of every TCP socket the given processes listen on."""
    inodes = _listening_inodes()
    found = []
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:[") and target[8:-1] in inodes:
                found.append((pid, *inodes[target[8:-1]]))
    return found


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback
