"""The egress network layout on its own, without a node: ``EgressNetwork.attach`` gives a
namespace of the test's own (standing in for a sandbox's) a veth into an egress namespace of the
test's own, through netlink from this process; a failure at any step of it leaves no veth, no
address and no thread in another namespace behind. What is left is checked with ``ip``, not with
the code under test."""

from __future__ import annotations

import errno
import os
import re
import secrets
import subprocess
import threading

import pytest
from dsec_security_ebpf import EgressNetwork, veth_name

from dsec_core.errors import NetlinkError, ToolError
from dsec_core.linux.netlink import Netlink
from dsec_core.linux.netns import add_netns, delete_netns, ip_batch, links, run_in_netns

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root")


def netns_of_threads() -> set[str]:
    return {os.readlink(f"/proc/self/task/{t}/ns/net") for t in os.listdir("/proc/self/task")}


@pytest.fixture
def net(tmp_path):
    """An egress namespace of the test's own (removed at the end; it must be unused then)."""
    network = EgressNetwork(tmp_path)
    yield network
    assert network.remove_if_unused(), f"veths left in {network.name}: {network.users()}"
    assert not network.exists()


@pytest.fixture
def sandbox_ns():
    """A network namespace standing in for a sandbox's; its path."""
    name = f"dsec-test-sb{secrets.token_hex(3)}"
    add_netns(name)
    try:
        yield f"/run/netns/{name}"
    finally:
        delete_netns(name)


def host_disable_ipv6() -> str | None:
    try:
        with open("/proc/sys/net/ipv6/conf/eth0/disable_ipv6") as f:
            return f.read()
    except FileNotFoundError:
        return None


def left_behind(net: EgressNetwork, sandbox_ns: str) -> dict[str, list[str]]:
    routes = run_in_netns(net.name, ["ip", "-4", "route"], "routes").splitlines()
    return {
        "egress links": [n for n in links(net.name) if n != "lo"],
        "egress routes": [r for r in routes if "dsv" in r],
        "sandbox links": [n for n in links(sandbox_ns) if n != "lo"],
        "sandbox addresses": run_in_netns(
            sandbox_ns, ["ip", "-4", "-o", "addr", "show", "scope", "global"], "addresses"
        ).splitlines(),
    }


NOTHING = {"egress links": [], "egress routes": [], "sandbox links": [], "sandbox addresses": []}


def test_attach_sets_up_both_sides_and_detach_removes_them(net, sandbox_ns, tmp_path):
    before = netns_of_threads()
    host_eth0 = host_disable_ipv6()
    addr = net.attach("sb-one", sandbox_ns)
    assert net.address_of("sb-one") == addr and addr.startswith("10.231.")
    # what a restarted daemon reads back from the namespace's routes
    assert EgressNetwork(tmp_path).address_of("sb-one") == addr
    assert net.users() == [veth_name("sb-one")]
    inside = run_in_netns(sandbox_ns, ["ip", "-4", "addr", "show", "eth0"], "eth0")
    assert f"inet {addr}/32" in inside and ",UP" in inside.splitlines()[0]
    route = run_in_netns(sandbox_ns, ["ip", "route"], "routes")
    assert "default via 169.254.0.1 dev eth0 onlink" in route
    ipv6 = run_in_netns(
        sandbox_ns, ["cat", "/proc/sys/net/ipv6/conf/eth0/disable_ipv6"], "disable_ipv6"
    )
    assert ipv6.strip() == "1"
    assert host_disable_ipv6() == host_eth0  # the sandbox namespace's eth0, not the host's
    gateway = run_in_netns(net.name, ["ip", "-4", "route", "get", addr], "route to it")
    assert f"dev {veth_name('sb-one')}" in gateway
    net.detach("sb-one")
    net.detach("sb-one")  # already on its way: no error
    assert net.address_of("sb-one") is None
    assert net.settle()
    net.detach("sb-one")  # gone: no error
    assert net.settle()
    assert left_behind(net, sandbox_ns) == NOTHING
    assert net.address_of("sb-one") is None
    assert netns_of_threads() == before


def test_a_failure_at_any_step_of_attach_leaves_nothing(net, sandbox_ns, monkeypatch):
    # every netlink request attach sends, in order, from a run that succeeds
    sent: list[str] = []
    request = Netlink.request

    def recording(self, kind, flags, body, what):
        sent.append(what)
        return request(self, kind, flags, body, what)

    monkeypatch.setattr(Netlink, "request", recording)
    first = net.attach("sb-two", sandbox_ns)
    steps = [re.sub(r"device \d+", "device N", what) for what in sent]
    net.detach("sb-two")
    assert net.settle()
    assert len(steps) >= 8, steps  # the veth, and address, link and route on both sides

    threads = threading.active_count()
    before = netns_of_threads()
    for failing in range(len(steps)):
        calls = 0

        def failing_at(self, kind, flags, body, what, failing=failing):
            nonlocal calls
            calls += 1
            if calls == failing + 1:
                raise NetlinkError(f"injected at {what}", operation=what, errno=errno.EIO)
            return request(self, kind, flags, body, what)

        monkeypatch.setattr(Netlink, "request", failing_at)
        with pytest.raises(NetlinkError) as e:
            net.attach("sb-two", sandbox_ns)
        assert re.sub(r"device \d+", "device N", str(e.value)) == f"injected at {steps[failing]}"
        monkeypatch.setattr(Netlink, "request", request)
        assert left_behind(net, sandbox_ns) == NOTHING, f"after a failure at {steps[failing]}"
        assert net.address_of("sb-two") is None
        assert netns_of_threads() == before
    assert threading.active_count() == threads
    # and the same sandbox attaches cleanly afterwards, to the address it had: it was freed
    assert net.attach("sb-two", sandbox_ns) == first
    net.detach("sb-two")
    assert net.settle()


def test_the_kernel_refusing_the_sandbox_side_leaves_nothing(net, sandbox_ns):
    # a default route the sandbox namespace already has: the last step of attach is refused
    ip_batch(sandbox_ns, ["route add default dev lo"], "a default route in the way")
    before = netns_of_threads()
    with pytest.raises(NetlinkError, match="File exists") as e:
        net.attach("sb-three", sandbox_ns)
    assert e.value.errno == errno.EEXIST and e.value.netns == sandbox_ns
    assert left_behind(net, sandbox_ns) == NOTHING
    assert netns_of_threads() == before


def test_a_sandbox_that_is_gone_fails_cleanly_with_a_typed_error(net):
    # a process's namespace, as the daemon passes it, once the process has gone
    proc = subprocess.Popen(["true"])
    proc.wait()
    with pytest.raises(NetlinkError, match="No such file") as e:
        net.attach("sb-four", f"/proc/{proc.pid}/ns/net")
    assert e.value.errno == errno.ENOENT
    assert net.address_of("sb-four") is None
    assert [n for n in links(net.name) if n != "lo"] == []


def test_a_detached_sandboxs_address_is_reused_only_once_its_veth_is_gone(tmp_path):
    # two addresses: the third sandbox gets the first one's, after its veth and route went
    net = EgressNetwork(tmp_path, subnet="10.233.0.0/30")
    names = [f"dsec-test-sb{secrets.token_hex(3)}" for _ in range(3)]
    for name in names:
        add_netns(name)
    try:
        paths = [f"/run/netns/{name}" for name in names]
        a, b = net.attach("sb-a", paths[0]), net.attach("sb-b", paths[1])
        net.detach("sb-a")  # returns at once; the kernel takes its time
        assert net.attach("sb-c", paths[2]) == a != b
        assert sorted(links(net.name)) == sorted(["lo", veth_name("sb-b"), veth_name("sb-c")])
        with pytest.raises(ToolError, match="no free address"):
            net.attach("sb-d", paths[0])  # nothing is being removed: no waiting, an error
        for sid in ("sb-b", "sb-c"):
            net.detach(sid)
    finally:
        for name in names:
            delete_netns(name)
        assert net.remove_if_unused()  # waits for the removals in flight
