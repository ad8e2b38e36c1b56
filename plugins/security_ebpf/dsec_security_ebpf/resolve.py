"""Resolving the domains of egress rules on the node (never in the sandbox): a hosts-style file
(``DSEC_EGRESS_HOSTS``) first, then the DNS server ``DSEC_EGRESS_DNS`` (``ADDRESS[:PORT]``,
asked directly over UDP for A and AAAA records), or else the host's own resolver. Answers are
cached for ``DSEC_EGRESS_REFRESH`` seconds, the schedule on which the policy re-resolves.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import socket
import struct
import threading
import time
from collections.abc import Iterable
from pathlib import Path

__all__ = ["Resolver", "dns_query"]

A, AAAA = 1, 28


def _encode_name(name: str) -> bytes:
    return b"".join(bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\0"


def _skip_name(msg: bytes, off: int) -> int:
    while True:
        n = msg[off]
        if n == 0:
            return off + 1
        if n & 0xC0 == 0xC0:  # a compression pointer ends the name
            return off + 2
        off += 1 + n


def dns_query(server: tuple[str, int], name: str, qtype: int, timeout: float = 1.0) -> list[str]:
    """The addresses a DNS server answers for ``name`` (record type A or AAAA); [] if none or
    no answer in ``timeout`` seconds."""
    qid = secrets.randbits(16)
    query = struct.pack("!HHHHHH", qid, 0x0100, 1, 0, 0, 0) + _encode_name(name)
    query += struct.pack("!HH", qtype, 1)
    family = socket.AF_INET6 if ":" in server[0] else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.settimeout(timeout)
        s.connect(server)
        s.send(query)
        deadline = time.monotonic() + timeout
        while True:
            s.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                msg = s.recv(4096)
            except (TimeoutError, ConnectionRefusedError):
                return []
            if len(msg) >= 12 and struct.unpack("!H", msg[:2])[0] == qid:
                break
    _, flags, qd, an, _, _ = struct.unpack("!HHHHHH", msg[:12])
    if flags & 0x000F:  # NXDOMAIN, SERVFAIL, ...
        return []
    off = 12
    for _ in range(qd):
        off = _skip_name(msg, off) + 4
    out = []
    for _ in range(an):
        off = _skip_name(msg, off)
        rtype, _, _, length = struct.unpack("!HHIH", msg[off : off + 10])
        off += 10
        data = msg[off : off + length]
        off += length
        if rtype == qtype == A and length == 4:
            out.append(str(ipaddress.IPv4Address(data)))
        elif rtype == qtype == AAAA and length == 16:
            out.append(str(ipaddress.IPv6Address(data)))
    return out


def _parse_server(text: str) -> tuple[str, int]:
    host, port = text, 53
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port = int(rest[1:]) if rest.startswith(":") else 53
    elif text.count(":") == 1:
        host, _, p = text.partition(":")
        port = int(p)
    return host, port


class Resolver:
    """Names to addresses, cached for ``refresh`` seconds; the node's configuration comes from
    the environment (``DSEC_EGRESS_HOSTS``, ``DSEC_EGRESS_DNS``, ``DSEC_EGRESS_REFRESH``)."""

    def __init__(
        self,
        hosts: Path | None = None,
        server: tuple[str, int] | None = None,
        refresh: float = 60.0,
    ) -> None:
        self.hosts = hosts
        self.server = server
        self.refresh = refresh
        self._cache: dict[str, tuple[float, tuple[str, ...]]] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_env(cls) -> Resolver:
        hosts = os.environ.get("DSEC_EGRESS_HOSTS")
        server = os.environ.get("DSEC_EGRESS_DNS")
        return cls(
            hosts=Path(hosts) if hosts else None,
            server=_parse_server(server) if server else None,
            refresh=float(os.environ.get("DSEC_EGRESS_REFRESH", "60")),
        )

    def _from_hosts(self, name: str) -> list[str]:
        if self.hosts is None:
            return []
        try:
            text = self.hosts.read_text()
        except OSError:
            return []
        out = []
        for line in text.splitlines():
            fields = line.split("#", 1)[0].split()
            if len(fields) >= 2 and name in (f.lower() for f in fields[1:]):
                try:
                    out.append(str(ipaddress.ip_address(fields[0])))
                except ValueError:
                    continue
        return out

    def _lookup(self, name: str) -> tuple[str, ...]:
        found = self._from_hosts(name)
        if not found and self.server is not None:
            found = dns_query(self.server, name, A) + dns_query(self.server, name, AAAA)
        elif not found:
            try:
                infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
            except (OSError, UnicodeError):
                infos = []
            found = [str(info[4][0]) for info in infos]
        return tuple(sorted(set(found)))

    def resolve(self, names: Iterable[str], fresh: bool = False) -> dict[str, tuple[str, ...]]:
        """Each name's addresses (empty if it does not resolve); from the cache unless older
        than ``refresh`` or ``fresh``."""
        out = {}
        now = time.monotonic()
        for name in sorted(set(names)):
            with self._lock:
                hit = self._cache.get(name)
            if hit is not None and not fresh and now - hit[0] < self.refresh:
                out[name] = hit[1]
                continue
            addrs = self._lookup(name)
            with self._lock:
                self._cache[name] = (time.monotonic(), addrs)
            out[name] = addrs
        return out
