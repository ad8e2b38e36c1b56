"""Rule parsing: what is accepted, the keys it becomes, and a typed error naming the rule for
everything else (no root needed)."""

from __future__ import annotations

import ipaddress

import pytest
from dsec_security_ebpf import EgressPolicy, parse_rule, parse_settings
from dsec_security_ebpf.rules import INTERNET_DENIED, MAX_RULES, internet_rules, trie_entries

from dsec_core.errors import InvalidSpec


@pytest.mark.parametrize(
    "text, network, domain, port, protocol",
    [
        ("10.77.0.2/32:8080/tcp", "10.77.0.2/32", None, 8080, "tcp"),
        ("10.77.0.2:8080/tcp", "10.77.0.2/32", None, 8080, "tcp"),
        ("10.0.0.0/8:*/udp", "10.0.0.0/8", None, 0, "udp"),
        ("0.0.0.0/0:443/TCP", "0.0.0.0/0", None, 443, "tcp"),
        ("[fd00::/64]:53/udp", "fd00::/64", None, 53, "udp"),
        ("[2001:db8::1]:443/tcp", "2001:db8::1/128", None, 443, "tcp"),
        ("pypi.example:443/tcp", None, "pypi.example", 443, "tcp"),
        ("Files.PyPI.example.:443/tcp", None, "files.pypi.example", 443, "tcp"),
        ("123.example:65535/udp", None, "123.example", 65535, "udp"),
    ],
)
def test_good_rules(text, network, domain, port, protocol):
    rule = parse_rule(text)
    assert rule.network == (ipaddress.ip_network(network) if network else None)
    assert (rule.domain, rule.port, rule.protocol) == (domain, port, protocol)


@pytest.mark.parametrize(
    "text, why",
    [
        ("10.0.0.300/32:80/tcp", "bad CIDR"),
        ("10.0.0.1/8:80/tcp", "bad CIDR"),  # host bits set: say so, do not widen it
        ("10.0.0.0/33:80/tcp", "bad CIDR"),
        ("1.2.3:80/tcp", "bad CIDR"),
        ("10.0.0.1:80/icmp", "unknown protocol 'icmp'"),
        ("10.0.0.1:80/sctp", "unknown protocol"),
        ("10.0.0.1:0/tcp", "out of range"),
        ("10.0.0.1:65536/tcp", "out of range"),
        ("10.0.0.1:-1/tcp", "not a number"),
        ("10.0.0.1:http/tcp", "not a number"),
        ("10.0.0.1/tcp", "expected DESTINATION:PORT/PROTOCOL"),
        ("10.0.0.1:80", "expected DESTINATION:PORT/PROTOCOL"),
        ("fd00::1:80/tcp", "in brackets"),
        ("[fd00::1:80/tcp", "in brackets"),
        ("[fd00::zz]:80/tcp", "bad CIDR"),
        ("exa_mple.com:80/tcp", "neither a CIDR nor a domain"),
        ("-bad.example:80/tcp", "neither a CIDR nor a domain"),
        (":80/tcp", "neither a CIDR nor a domain"),
        (42, "a rule is a string"),
    ],
)
def test_bad_rules_are_typed_errors_naming_the_rule(text, why):
    with pytest.raises(InvalidSpec, match=why) as err:
        parse_rule(text, "allow[3]")
    assert err.value.field == "allow[3]"
    assert str(text) in str(err.value)
    assert err.value.http_status == 422


def test_settings():
    assert parse_settings({}) == ()
    assert len(parse_settings({"allow": ["10.0.0.1:1/tcp", "a.example:2/udp"]})) == 2
    with pytest.raises(InvalidSpec, match="unknown setting"):
        parse_settings({"allow": [], "deny": []})
    with pytest.raises(InvalidSpec, match="a list of rules"):
        parse_settings({"allow": "10.0.0.1:80/tcp"})
    with pytest.raises(InvalidSpec, match=r"allow\[1\]"):
        parse_settings({"allow": ["10.0.0.1:80/tcp", "10.0.0.1:80/gre"]})
    with pytest.raises(InvalidSpec):
        EgressPolicy().validate({"allow": ["10.0.0.1:99999/tcp"]})
    too_many = [f"10.0.{i // 256}.{i % 256}:80/tcp" for i in range(MAX_RULES + 1)]
    with pytest.raises(InvalidSpec, match=f"a sandbox may have {MAX_RULES}") as err:
        parse_settings({"allow": too_many})
    assert err.value.field == "allow"
    assert len(parse_settings({"allow": too_many[:MAX_RULES]})) == MAX_RULES


def test_trie_keys():
    rules = parse_settings(
        {"allow": ["10.77.0.0/24:8080/tcp", "a.example:*/udp", "[fd00::/8]:53/udp"]}
    )
    keys = trie_entries(rules, {"a.example": ("10.1.2.3", "fd00::5")})
    # prefixlen (little-endian u32) counts protocol, padding and port: 32 + the CIDR's length
    assert keys["allow4"] == {
        (56).to_bytes(4, "little")
        + bytes([6, 0])
        + (8080).to_bytes(2, "big")
        + bytes([10, 77, 0, 0]),
        (64).to_bytes(4, "little") + bytes([17, 0, 0, 0]) + bytes([10, 1, 2, 3]),
    }
    assert len(keys["allow6"]) == 2
    assert trie_entries(rules, {}) == {
        "allow4": {next(k for k in keys["allow4"] if k[4] == 6)},
        "allow6": {next(k for k in keys["allow6"] if k[0] == 40)},
    }


def test_internet_rules_cover_every_address_but_the_denied_ranges():
    rules = internet_rules()
    nets = {r.network for r in rules}
    assert len(nets) == 51 and len(rules) == 102  # each network for tcp and udp, any port
    assert {(r.protocol, r.port) for r in rules} == {("tcp", 0), ("udp", 0)}
    total = sum(n.num_addresses for n in nets) + sum(d.num_addresses for d in INTERNET_DENIED)
    assert total == 1 << 32  # together they are the whole IPv4 space, without overlap

    def allowed(addr):
        return any(ipaddress.ip_address(addr) in n for n in nets)

    for addr in ("8.8.8.8", "1.1.1.1", "198.51.100.2", "203.0.113.9", "172.32.0.1", "100.63.0.1"):
        assert allowed(addr), addr
    for addr in ("10.1.2.3", "172.16.0.1", "192.168.1.1", "100.64.0.1", "169.254.169.254",
                 "127.0.0.1", "0.0.0.0", "224.0.0.1", "255.255.255.255"):  # fmt: skip
        assert not allowed(addr), addr
    assert trie_entries(rules, {})["allow4"] and not trie_entries(rules, {})["allow6"]
