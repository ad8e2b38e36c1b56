"""Egress rules: ``DESTINATION:PORT/PROTOCOL``, where the destination is a CIDR (``10.0.0.0/8``),
an address (``10.77.0.2``, ``[fd00::2]``) or a domain name (``pypi.example``), the port is
1-65535 or ``*`` for any, and the protocol ``tcp`` or ``udp``. Parsing is strict: a rule that
does not say exactly one thing is an ``InvalidSpec`` naming it, before any sandbox starts.
"""

from __future__ import annotations

import ipaddress
import re
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from dsec_core.errors import InvalidSpec

__all__ = [
    "INTERNET_DENIED",
    "MAX_RULES",
    "PROTOCOLS",
    "Rule",
    "internet_rules",
    "parse_rule",
    "parse_settings",
    "trie_entries",
]

PROTOCOLS = {"tcp": 6, "udp": 17}
#: Trie entries one sandbox may hold: rules, each domain counting the addresses it resolves to.
MAX_RULES = 4096
_LABEL = re.compile(r"^(?!-)[a-z0-9-]{1,63}(?<!-)$")
_HEAD = struct.Struct("<IBB")  # prefixlen, protocol, padding; then port and address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


#: What ``network="internet"`` keeps out unless an allow rule opens it: "this network",
#: private (RFC 1918), shared (100.64/10, carrier NAT), loopback, link-local (cloud metadata,
#: 169.254.169.254, among them), multicast and the reserved rest. IPv4 only: a sandbox's eth0
#: has no IPv6. The node's own addresses, whatever they are, are kept out on the host (the
#: uplink's table in ``network``).
INTERNET_DENIED = tuple(
    ipaddress.IPv4Network(n)
    for n in (
        "0.0.0.0/8",
        "10.0.0.0/8",
        "100.64.0.0/10",
        "127.0.0.0/8",
        "169.254.0.0/16",
        "172.16.0.0/12",
        "192.168.0.0/16",
        "224.0.0.0/4",
        "240.0.0.0/4",
    )
)


@dataclass(frozen=True)
class Rule:
    """One allowed destination: a network or a domain (resolved by the node), a port (0: any)
    and a protocol."""

    text: str
    port: int
    protocol: str
    network: Network | None = None
    domain: str | None = None


def _bad(field: str, text: Any, why: str) -> InvalidSpec:
    return InvalidSpec(f"{field}: {text!r}: {why}", field=field, value=str(text))


def parse_rule(text: Any, field: str = "allow") -> Rule:
    """One rule from its text; ``InvalidSpec`` naming ``field`` and saying what is wrong."""
    if not isinstance(text, str):
        raise _bad(field, text, "a rule is a string DESTINATION:PORT/PROTOCOL")
    rest, slash, proto = text.strip().rpartition("/")
    if not slash or ":" not in rest:
        raise _bad(field, text, "expected DESTINATION:PORT/PROTOCOL, e.g. 10.0.0.0/8:443/tcp")
    proto = proto.lower()
    if proto not in PROTOCOLS:
        raise _bad(field, text, f"unknown protocol {proto!r} (known: {', '.join(PROTOCOLS)})")
    dest, _, port_text = rest.rpartition(":")
    port = _parse_port(field, text, port_text)
    if dest.startswith("["):  # [v6 address or CIDR]
        if not dest.endswith("]"):
            raise _bad(field, text, "an IPv6 destination goes in brackets: [fd00::/8]:443/tcp")
        return Rule(text, port, proto, network=_parse_network(field, text, dest[1:-1]))
    if ":" in dest:
        raise _bad(field, text, "an IPv6 destination goes in brackets: [fd00::/8]:443/tcp")
    if dest and (dest[0].isdigit() and re.fullmatch(r"[0-9./]+", dest)):
        return Rule(text, port, proto, network=_parse_network(field, text, dest))
    return Rule(text, port, proto, domain=_parse_domain(field, text, dest))


def _parse_port(field: str, text: str, port: str) -> int:
    if port == "*":
        return 0
    if not port.isdigit():
        raise _bad(field, text, f"port {port!r} is not a number or *")
    n = int(port)
    if not 1 <= n <= 65535:
        raise _bad(field, text, f"port {n} is out of range (1-65535, or * for any)")
    return n


def _parse_network(field: str, text: str, dest: str) -> Network:
    try:
        return ipaddress.ip_network(dest, strict=True)
    except ValueError as e:
        raise _bad(field, text, f"bad CIDR {dest!r}: {e}") from None


def _parse_domain(field: str, text: str, dest: str) -> str:
    name = dest.lower().rstrip(".")
    labels = name.split(".")
    if not name or len(name) > 253 or not all(_LABEL.match(label) for label in labels):
        raise _bad(field, text, f"{dest!r} is neither a CIDR nor a domain name")
    if labels[-1].isdigit():
        raise _bad(field, text, f"bad CIDR {dest!r}")
    return name


def parse_settings(settings: Mapping[str, Any]) -> tuple[Rule, ...]:
    """The rules of a policy's settings ``{"allow": [rule, ...]}``; unknown keys are refused."""
    if not isinstance(settings, Mapping):
        raise InvalidSpec("egress: settings must be an object", field="settings")
    unknown = sorted(set(settings) - {"allow"})
    if unknown:
        raise InvalidSpec(
            f"egress: unknown setting(s) {', '.join(unknown)} (known: allow)", field=unknown[0]
        )
    allow = settings.get("allow", [])
    if not isinstance(allow, list | tuple):
        raise _bad("allow", allow, "a list of rules DESTINATION:PORT/PROTOCOL")
    if len(allow) > MAX_RULES:
        raise InvalidSpec(
            f"egress: {len(allow)} rules; a sandbox may have {MAX_RULES}", field="allow"
        )
    return tuple(parse_rule(r, f"allow[{i}]") for i, r in enumerate(allow))


def _internet() -> list[ipaddress.IPv4Network]:
    nets = [ipaddress.IPv4Network("0.0.0.0/0")]
    for denied in INTERNET_DENIED:
        out: list[ipaddress.IPv4Network] = []
        for n in nets:
            if denied.subnet_of(n):
                out += n.address_exclude(denied)
            elif not n.subnet_of(denied):
                out.append(n)
        nets = out
    return sorted(nets)


def internet_rules() -> tuple[Rule, ...]:
    """The rules of ``network="internet"``: every IPv4 address but ``INTERNET_DENIED``, any
    port, TCP and UDP (51 networks, 102 trie entries; the programs need no other mode)."""
    return tuple(
        Rule(f"{net}:*/{proto}", 0, proto, network=net)
        for net in _internet()
        for proto in PROTOCOLS
    )


def trie_entries(
    rules: Iterable[Rule], resolved: Mapping[str, Iterable[str]]
) -> dict[str, set[bytes]]:
    """The keys of the ``allow4`` and ``allow6`` tries for ``rules``, domains taken from
    ``resolved`` (name -> addresses; a name not there allows nothing yet)."""
    out: dict[str, set[bytes]] = {"allow4": set(), "allow6": set()}
    for rule in rules:
        if rule.network is not None:
            networks: list[Network] = [rule.network]
        else:
            networks = [ipaddress.ip_network(a) for a in resolved.get(rule.domain or "", ())]
        for net in networks:
            key = (
                _HEAD.pack(32 + net.prefixlen, PROTOCOLS[rule.protocol], 0)
                + rule.port.to_bytes(2, "big")
                + net.network_address.packed
            )
            out["allow4" if net.version == 4 else "allow6"].add(key)
    return out
