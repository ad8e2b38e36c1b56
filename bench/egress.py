#!/usr/bin/env python3
"""What the egress policy costs, against the same sandboxes without it, in one run.

- create: create -> first exec (`true`) -> kill of a busybox sandbox, with no policy
  (loopback only) and with ``network="allowlist"`` and the ``egress`` policy (BPF programs
  loaded and attached, maps pinned and filled, a veth into the egress namespace, /etc/hosts);
- connect: the mean time of one TCP connect to a listener on the sandbox's own loopback
  (``netprobe loopconnect``), without and with the programs on the cgroup: what the connect and
  packet hooks add to every connection.

    python bench/egress.py [--quick]

The node is a private one (the kit's), with a DNS server of its own on loopback. The last line
printed is one JSON object of the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from dsec_security_ebpf.testing import build_probe, egress_kit_node

from dsec_core.records import SandboxSpec

RULES = ["10.77.0.0/16:*/tcp", "10.78.0.0/16:53/udp", "[fd00::/8]:443/tcp"]


def create_cost(client, spec: SandboxSpec, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        sb = client.create(spec)
        sb.exec("true")
        client.kill(sb.id)
        out.append(time.perf_counter() - t0)
    return out


def connect_ns(client, specs: list[SandboxSpec], probe: bytes, n: int, rounds: int) -> list[float]:
    """For each spec, the fastest of ``rounds`` runs of ``n`` loopback connects (ns per
    connect); the sandboxes take turns, so a busy neighbour slows both alike."""
    sbs = [client.create(spec) for spec in specs]
    try:
        for sb in sbs:
            sb.write_file("/bin/netprobe", probe, mode=0o755)
        runs: list[list[int]] = [[] for _ in sbs]
        for _ in range(rounds):
            for sb, out in zip(sbs, runs, strict=True):
                out.append(int(sb.exec(["/bin/netprobe", "loopconnect", str(n)]).text))
    finally:
        for sb in sbs:
            client.kill(sb.id)
    return [min(r) for r in runs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (about 15 s)")
    args = parser.parse_args()
    creates, connects, rounds = (10, 2000, 5) if args.quick else (40, 10000, 15)
    with tempfile.TemporaryDirectory(prefix="dsec-bench-egress-") as tmp:
        probe = build_probe(Path(tmp)).read_bytes()
        with egress_kit_node(Path(tmp)) as egress, egress.node.client() as client:
            base = SandboxSpec(layers=(egress.node.layer.ref,), backend="container", ttl=600)
            policed = SandboxSpec(
                **{
                    **base.to_dict(),
                    "network": "allowlist",
                    "policies": {"egress": {"allow": RULES}},
                }
            )
            create_cost(client, policed, 2)  # compile the programs, make the egress namespace
            plain_c, egress_c = [], []
            for _ in range(2):  # interleaved, so drift on a shared machine hits both
                plain_c += create_cost(client, base, creates // 2)
                egress_c += create_cost(client, policed, creates // 2)
            plain_ns, egress_ns = connect_ns(client, [base, policed], probe, connects, rounds)
    p50 = {k: statistics.median(v) * 1e3 for k, v in (("plain", plain_c), ("egress", egress_c))}
    print(f"{'measure':<40}{'no policy':>12}{'egress':>12}")
    print(f"{'create -> exec -> kill, p50 (ms)':<40}{p50['plain']:>12.1f}{p50['egress']:>12.1f}")
    name = "loopback TCP connect, best mean (us)"
    print(f"{name:<40}{plain_ns / 1e3:>12.1f}{egress_ns / 1e3:>12.1f}")
    print(
        json.dumps(
            {
                "create_p50_ms": round(p50["plain"], 2),
                "create_p50_ms_egress": round(p50["egress"], 2),
                "create_overhead_ms": round(p50["egress"] - p50["plain"], 2),
                "create_overhead_ratio": round(p50["egress"] / p50["plain"], 3),
                "connect_us": round(plain_ns / 1e3, 2),
                "connect_us_egress": round(egress_ns / 1e3, 2),
                "connect_overhead_ratio": round(egress_ns / plain_ns, 3),
            }
        )
    )


if __name__ == "__main__":
    main()
