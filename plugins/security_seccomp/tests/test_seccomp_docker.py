"""Docker's default seccomp profile is the reference: the same probe runs in a dsec sandbox under
this plugin's profile and under `docker run` with Docker's default, and everything Docker
denies, dsec denies too. Docker runs in a private dockerd this test starts (its own socket and
data root, no bridge, no iptables); the Docker half skips, saying why, where none can start."""

from __future__ import annotations

import os
import tarfile

import pytest
from dsec_security_seccomp.probe import parse_probe, run_probe

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="sandboxes and dockerd need root")

#: Where dsec allows what Docker's default refuses, on purpose.
DELIBERATE = {
    # unshare without namespace flags only unshares the caller's own fs and fd table; the
    # profile filters unshare's flags (as it does clone's) instead of refusing the call.
    "unshare_fs": "unshare(CLONE_FS | CLONE_FILES) is allowed; namespace flags are not",
}
IMAGE = "dsec-seccomp-probe:1"


@pytest.fixture(scope="module")
def docker_results(dsec_dockerd, probe, tmp_path_factory) -> dict[str, dict[str, str]]:
    """The probe's results under Docker's default profile and with seccomp unconfined."""
    tar = tmp_path_factory.mktemp("image") / "image.tar"
    with tarfile.open(tar, "w") as t:
        t.add(probe, "probe")
        t.add("/bin/busybox", "bin/busybox")
        tmp = tarfile.TarInfo("tmp")
        tmp.type, tmp.mode = tarfile.DIRTYPE, 0o1777
        t.addfile(tmp)
    imported = dsec_dockerd.run("import", os.fspath(tar), IMAGE)
    assert imported.returncode == 0, imported.stderr
    out = {}
    for name, extra in (("default", []), ("unconfined", ["--security-opt", "seccomp=unconfined"])):
        r = dsec_dockerd.run(
            "run", "--rm", "--network", "none", *extra, "-e", "PROBE_DST=/tmp/dst",
            IMAGE, "/probe", "all",
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
        out[name] = parse_probe(r.stdout)
    return out


def test_dsec_denies_everything_dockers_default_denies(dsec_sandboxes, probe, docker_results):
    sb = dsec_sandboxes.create()
    ours = run_probe(sb, probe, env={"PROBE_DST": "/tmp/dst"})
    theirs = docker_results["default"]
    unconfined = docker_results["unconfined"]
    assert set(ours) == set(theirs), "the probe ran different attempts"
    rows = [
        f"{n:22} docker {theirs[n]:11} (unconfined {unconfined[n]:11}) dsec {ours[n]}"
        for n in sorted(ours)
    ]
    print("\n".join(rows))
    docker_denied = {n for n, r in theirs.items() if r != "ok"}
    dsec_denied = {n for n, r in ours.items() if r != "ok"}
    assert docker_denied - dsec_denied == set(DELIBERATE), {
        n: (theirs[n], ours[n]) for n in docker_denied - dsec_denied
    }
    # What Docker's filter itself refuses (denied by default, allowed unconfined): dsec refuses
    # it with the same EPERM, from its own filter (or ENOSYS where Docker says ENOSYS too).
    docker_filter = {n for n in docker_denied if unconfined[n] == "ok"} - set(DELIBERATE)
    assert docker_filter, "Docker's filter denied nothing: the comparison measured nothing"
    assert {n: ours[n] for n in docker_filter} == {n: theirs[n] for n in docker_filter}
    # and where dsec goes further than this Docker: io_uring is always denied here
    for name in ("io_uring_setup", "i386_io_uring_setup", "socket_vsock", "ficlone"):
        assert ours[name] == "EPERM", name
