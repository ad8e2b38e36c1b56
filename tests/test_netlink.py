"""rtnetlink from the process (``dsec_core.linux.netlink``) and calls in another network
namespace (``call_in_netns``), against namespaces the tests make: what a request does is
checked with ``ip``, refusals carry the kernel's errno and words, and no thread of the process
is ever left in another namespace."""

from __future__ import annotations

import errno
import os
import secrets
import socket

import pytest

from dsec_core.errors import NetlinkError
from dsec_core.linux.netlink import Link, Netlink, Route
from dsec_core.linux.netns import add_netns, call_in_netns, delete_netns, links, run_in_netns

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root")


def netns_of_threads() -> set[str]:
    return {os.readlink(f"/proc/self/task/{t}/ns/net") for t in os.listdir("/proc/self/task")}


@pytest.fixture
def two():
    """Two network namespaces of the test's own; their names."""
    tag = secrets.token_hex(3)
    names = [f"dsec-test-a{tag}", f"dsec-test-b{tag}"]
    for name in names:
        add_netns(name)
    try:
        yield names
    finally:
        for name in names:
            delete_netns(name)


def test_call_in_netns_runs_there_and_leaves_every_thread_where_it_was(two):
    before = netns_of_threads()
    theirs = call_in_netns(two[0], lambda: os.readlink("/proc/thread-self/ns/net"))
    assert theirs not in before
    assert theirs == f"net:[{os.stat(f'/run/netns/{two[0]}').st_ino}]"

    def boom() -> None:
        raise ValueError("from inside")

    with pytest.raises(ValueError, match="from inside"):
        call_in_netns(two[0], boom)
    with pytest.raises(NetlinkError, match="No such file") as e:
        call_in_netns("dsec-test-no-such-netns", boom)
    assert e.value.errno == errno.ENOENT
    assert netns_of_threads() == before


def test_a_veth_across_namespaces_with_addresses_routes_and_state(two):
    a, b = two
    with Netlink.open(a) as nl:
        fd = os.open(f"/run/netns/{b}", os.O_RDONLY | os.O_CLOEXEC)
        try:
            nl.add_veth("va", "vb", fd)
        finally:
            os.close(fd)
        index = nl.link_index("va")
        assert Link(index, "va") in nl.links()
        nl.add_address(index, "10.79.5.1", 24)
        nl.set_up(index)
        nl.add_route("10.79.6.0", 24, index)
        assert Route("10.79.6.0", 24, index) in nl.routes()

    def other_side() -> None:
        with Netlink.open(label=b) as there:
            vb = there.link_index("vb")
            there.add_address(vb, "10.79.5.2", 24)
            there.set_up(vb)
            there.add_route("0.0.0.0", 0, vb, gateway="10.79.5.1")

    call_in_netns(b, other_side)
    assert "vb" not in links(a) and "va" not in links(b)  # each end only where it belongs
    assert "vb" not in links(None) and "va" not in links(None)
    assert "inet 10.79.5.1/24" in run_in_netns(a, ["ip", "addr", "show", "va"], "va")
    assert "10.79.6.0/24 dev va scope link" in run_in_netns(a, ["ip", "route"], "routes")
    assert "default via 10.79.5.1 dev vb" in run_in_netns(b, ["ip", "route"], "routes")
    # traffic crosses: sockets made in each namespace, used from this thread
    listener = call_in_netns(a, lambda: socket.create_server(("10.79.5.1", 0)))
    client = call_in_netns(b, socket.socket)
    with listener, client:
        client.settimeout(5)
        client.connect(("10.79.5.1", listener.getsockname()[1]))
        conn, peer = listener.accept()
        conn.close()
    assert peer[0] == "10.79.5.2"

    with Netlink.open(a) as nl:
        assert nl.delete_link("va") is True
        assert nl.delete_link("va") is False  # not there: no error
    assert links(a) == ["lo"] and links(b) == ["lo"]  # the peer went with it


def test_refusals_carry_the_errno_and_the_kernels_words(two):
    with Netlink.open(two[0]) as nl:
        with pytest.raises(NetlinkError) as e:
            nl.link_index("nothere0")
        assert e.value.errno == errno.ENODEV and e.value.netns == two[0]
        with pytest.raises(NetlinkError, match="File exists"):
            nl.add_address(1, "127.0.0.1", 8)  # lo has it
        # a route through a device that is down: the kernel says why, in words
        fd = os.open(f"/run/netns/{two[1]}", os.O_RDONLY | os.O_CLOEXEC)
        try:
            nl.add_veth("vdown", "vpeer", fd)
        finally:
            os.close(fd)
        with pytest.raises(NetlinkError, match=r"Network is down \(.*not up") as e:
            nl.add_route("10.79.7.0", 24, nl.link_index("vdown"))
        assert e.value.errno == errno.ENETDOWN
        nl.delete_link("vdown")
