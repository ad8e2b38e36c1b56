"""Attacks through the writable layer: filling the disk (bytes and inodes), planting a setuid-root
binary for host users to run, reading sandboxes' files from the host, and planting device nodes.

Each sandbox's writable layer is a filesystem of its own (an ext4 image the size of its
``disk``, loop-mounted nosuid,nodev under ``$DSEC_HOME/sandboxes``, mode 0700), and the
directories on the way to its root filesystem admit only root and the sandboxes' host group.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path

import pytest

from dsec_core.linux.tools import compile_static

EUID_C = r"""
#include <fcntl.h>
#include <stdio.h>
#include <unistd.h>
/* What a planted setuid binary would do: say whose privileges it runs with, then try to write
   where only that uid may (argv[1]). */
int main(int argc, char **argv) {
    printf("euid=%d\n", (int)geteuid());
    if (argc > 1) {
        int fd = open(argv[1], O_WRONLY | O_CREAT | O_TRUNC, 0644);
        printf("%s\n", fd >= 0 ? "wrote" : "denied");
    }
    return 0;
}
"""

NESTED_MKNOD_C = r"""
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <sched.h>
#include <stdio.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>
/* Root of a nested user namespace (with every capability there, and its own mount namespace)
   tries to make a device node: on the writable layer, and on a tmpfs it mounts itself. It maps
   its root to the sandbox's nobody: mapping the sandbox's root would need CAP_SETFCAP. */
static int put(const char *path, const char *text) {
    int fd = open(path, O_WRONLY);
    int ok = fd >= 0 && write(fd, text, strlen(text)) == (ssize_t)strlen(text);
    if (fd >= 0) close(fd);
    return ok ? 0 : -1;
}
static void try_mknod(const char *path) {
    if (mknod(path, S_IFCHR | 0666, makedev(1, 1)) == 0) printf("made %s\n", path);
    else printf("mknod %s: %s\n", path, strerror(errno));
}
int main(void) {
    if (setgroups(0, NULL) || setgid(65534) || setuid(65534)) { perror("drop"); return 2; }
    prctl(PR_SET_DUMPABLE, 1);  /* the uid change made /proc/self root's */
    if (unshare(CLONE_NEWUSER | CLONE_NEWNS)) { perror("unshare"); return 3; }
    if (put("/proc/self/setgroups", "deny") || put("/proc/self/uid_map", "0 65534 1")
        || put("/proc/self/gid_map", "0 65534 1")) { perror("map"); return 4; }
    FILE *st = fopen("/proc/self/status", "r");
    char line[256];
    while (st && fgets(line, sizeof line, st))
        if (!strncmp(line, "CapEff:", 7)) fputs(line, stdout);
    printf("uid=%d\n", (int)getuid());
    try_mknod("/tmp/mem");
    if (mount("none", "/", NULL, MS_REC | MS_PRIVATE, NULL) == 0
        && mount("x", "/tmp", "tmpfs", 0, NULL) == 0) {
        printf("mounted\n");
        try_mknod("/tmp/mem");
    } else {
        printf("mount: %s\n", strerror(errno));
    }
    return 0;
}
"""


def _static(tmp_path_factory, name: str, source: str) -> bytes:
    """A static program built from ``source``: the busybox sandbox has no loader or libc."""
    d = tmp_path_factory.mktemp(name)
    (d / f"{name}.c").write_text(source)
    return compile_static([d / f"{name}.c"], d / name, name, flags=["-O1"]).read_bytes()


def _as_nobody(*argv: str, groups: tuple[int, ...] = ()) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` on the host as uid/gid 65534 with no capabilities (and supplementary
    ``groups``), through a shell so a refused exec reports as a shell does. (Not ``setpriv
    --reuid``: util-linux 2.38's keeps root's capabilities until its own execve, so that execve
    reaches paths nobody could.)"""
    return subprocess.run(
        ["/bin/sh", "-c", 'exec "$@"', "sh", *argv],
        user=65534,
        group=65534,
        extra_groups=list(groups),
        capture_output=True,
        text=True,
        timeout=30,
        stdin=subprocess.DEVNULL,
    )


@pytest.fixture(scope="module")
def euid_binary(tmp_path_factory) -> bytes:
    """Prints its effective uid and tries to write a file."""
    return _static(tmp_path_factory, "euid", EUID_C)


@pytest.fixture(scope="module")
def nested_mknod_binary(tmp_path_factory) -> bytes:
    return _static(tmp_path_factory, "nested_mknod", NESTED_MKNOD_C)


def _host_paths(node, sandbox_id: str) -> tuple[Path, Path]:
    """Where a sandbox's files show on the host: its writable layer and its root filesystem."""
    upper = node.config.sandbox_dir / sandbox_id / "upper"
    return upper, node.config.runtime_dir / sandbox_id / "rootfs"


def _flags(path: Path) -> tuple[bool, bool]:
    st = os.statvfs(path)
    return bool(st.f_flag & os.ST_NOSUID), bool(st.f_flag & os.ST_NODEV)


@pytest.mark.attack("a disk fill: 8 GiB written into a 256 MiB writable layer")
def test_disk_fill_stops_at_the_quota(dsec_sandboxes, dsec_node, witness, tmp_path):
    filler = dsec_sandboxes.create(disk="256M")
    other = dsec_sandboxes.create()
    image = dsec_node.config.disk_dir / f"{filler.id}.img"
    result: dict = {}

    def fill() -> None:
        result["r"] = filler.exec(
            "dd if=/dev/zero of=/root/fill bs=1M count=8192", timeout=120, max_output=4096
        )

    t0 = time.monotonic()
    thread = threading.Thread(target=fill)
    thread.start()
    # While it fills: another sandbox and the host write as usual.
    for i in range(4):
        r = other.exec(f"dd if=/dev/zero of=/root/w{i} bs=1M count=16 conv=fsync 2>&1", timeout=60)
        assert r.exit_code == 0, r.text
        with open(tmp_path / f"host{i}", "wb") as f:
            f.write(os.urandom(16 << 20))
            os.fsync(f.fileno())
    thread.join(150)
    assert not thread.is_alive()
    r = result["r"]
    took = time.monotonic() - t0
    assert r.exit_code != 0 and b"No space left on device" in r.stderr, r
    size = int(filler.exec("stat -c %s /root/fill").text)
    assert 200 << 20 < size <= 256 << 20, size
    # the host paid for what was written, at most the quota, however much was attempted
    assert image.stat().st_blocks * 512 <= (256 << 20) + (1 << 20)
    assert took < 120
    # the sandbox itself goes on: it executes, and writes again once it has made room
    assert filler.exec("echo alive").stdout == b"alive\n"
    r = filler.exec("rm /root/fill && dd if=/dev/zero of=/root/again bs=1M count=8 && echo ok")
    assert r.stdout.endswith(b"ok\n"), r
    assert other.exec("stat -c %s /root/w3").stdout == b"16777216\n"
    assert os.path.getsize(tmp_path / "host3") == 16 << 20


@pytest.mark.attack("a disk fill with sparse files and fallocate beyond the quota")
def test_sparse_and_fallocate_cannot_pass_the_quota(dsec_sandboxes, dsec_node, witness):
    sb = dsec_sandboxes.create(disk="64M")
    image = dsec_node.config.disk_dir / f"{sb.id}.img"
    # A huge sparse file costs nothing until it is written; writing it stops at the quota.
    r = sb.exec("truncate -s 1099511627776 /root/sparse && echo made")
    assert r.stdout == b"made\n", r
    r = sb.exec("dd if=/dev/zero of=/root/sparse bs=1M count=1024 conv=notrunc", timeout=60)
    assert r.exit_code != 0 and b"No space left on device" in r.stderr, r
    r = sb.exec("rm /root/sparse; fallocate -l 2147483648 /root/big")
    assert r.exit_code != 0, r
    assert image.stat().st_blocks * 512 <= (64 << 20) + (1 << 20)
    assert sb.exec("rm -f /root/big; echo x > /root/small && cat /root/small").stdout == b"x\n"


@pytest.mark.attack("inode exhaustion: millions of empty files")
def test_inode_exhaustion_stops_at_the_sandbox(dsec_sandboxes, witness):
    sb = dsec_sandboxes.create(disk="16M")  # 1024 inodes: one per 16 KiB
    r = sb.exec(
        "mkdir /root/many && cd /root/many && i=0; "
        "while [ $i -lt 1000000 ] && touch f$i 2>/dev/null; do i=$((i+1)); done; echo $i; "
        "touch one-more",
        timeout=120,
    )
    made = int(r.stdout.split()[0])
    assert 500 < made < 1024, r
    assert b"No space left on device" in r.stderr, r
    other = witness.bystander
    r = other.exec("mkdir /root/d && touch /root/d/a /root/d/b && ls /root/d")
    assert r.stdout == b"a\nb\n", r
    assert sb.exec("rm -r /root/many && touch /root/back && echo ok").stdout == b"ok\n"


@pytest.mark.attack("a setuid-root binary planted inside, run by an unprivileged host user")
def test_planted_setuid_binary_is_useless_from_the_host(
    dsec_sandboxes, dsec_node, witness, euid_binary
):
    sb = dsec_sandboxes.create()
    victim = dsec_sandboxes.create()
    sb.write_file("/root/euid", euid_binary, mode=0o755)
    r = sb.exec("chown 0:0 /root/euid && chmod 4755 /root/euid && ls -ln /root/euid")
    assert r.stdout.startswith(b"-rwsr-xr-x"), r
    upper, rootfs = _host_paths(dsec_node, sb.id)
    planted = upper / "root" / "euid"
    st = planted.stat()  # as root: the attacker's premise, a setuid file of the sandbox's uid
    owner = Path(f"/proc/{sb.info.pid}/status").read_text().split("Uid:")[1].split()[0]
    assert st.st_mode & 0o4000 and st.st_uid == int(owner) >= dsec_node.config.uid_base
    target = _host_paths(dsec_node, victim.id)[1] / "root" / "pwned"

    # An unprivileged host user can reach neither copy of it, nor run it.
    for path in (planted, rootfs / "root" / "euid"):
        r = _as_nobody(os.fspath(path), os.fspath(target))
        assert r.returncode != 0 and "Permission denied" in r.stderr, r
        assert "euid=" not in r.stdout
        assert _as_nobody("stat", os.fspath(path)).returncode != 0
    # Defence in depth: even with the sandboxes' own group, which may pass the directories on
    # the way to root filesystems, the writable layer stays shut, and the binary run through
    # the root filesystem gets no privileges (the overlay is nosuid).
    gid = (dsec_node.config.sandbox_gid,)
    r = _as_nobody(os.fspath(planted), groups=gid)
    assert r.returncode != 0 and "Permission denied" in r.stderr, r
    r = _as_nobody(os.fspath(rootfs / "root" / "euid"), os.fspath(target), groups=gid)
    assert r.stdout.split() == ["euid=65534", "denied"], r
    assert not target.exists()
    assert victim.exec("ls /root").stdout == b""
    # both mounts that hold the sandbox's files are nosuid and nodev
    assert _flags(upper) == (True, True)
    assert _flags(rootfs) == (True, True)


@pytest.mark.attack("read sandboxes' files under $DSEC_HOME as an unprivileged host user")
def test_host_users_cannot_read_sandbox_files(dsec_sandboxes, dsec_node, witness):
    sb = dsec_sandboxes.create()
    sb.exec("echo the-answer-is-42 > /root/answer && chmod 644 /root/answer").check()
    upper, rootfs = _host_paths(dsec_node, sb.id)
    home = dsec_node.home
    assert (upper / "root" / "answer").read_text() == "the-answer-is-42\n"  # root can
    for path in (upper / "root" / "answer", rootfs / "root" / "answer"):
        r = _as_nobody("cat", os.fspath(path))
        assert r.returncode != 0 and "the-answer" not in r.stdout, r
    for d in (home, home / "run", dsec_node.config.runtime_dir, dsec_node.config.sandbox_dir):
        r = _as_nobody("ls", os.fspath(d))
        assert r.returncode != 0 and sb.id not in r.stdout, (d, r)
    r = _as_nobody("grep", "-rs", "the-answer", os.fspath(home))
    assert r.returncode != 0 and r.stdout == "", r
    r = _as_nobody("find", os.fspath(home))
    assert r.stdout.split() == [os.fspath(home)], r


@pytest.mark.attack("plant a device node (directly, and from a nested user namespace)")
def test_planted_device_nodes_are_useless(dsec_sandboxes, dsec_node, witness, nested_mknod_binary):
    # the default seccomp profile refuses nested user namespaces outright; the attack is made
    # from one, so the sandbox asks for them
    sb = dsec_sandboxes.create(policies={"seccomp": {"userns": True}})
    r = sb.exec("mknod /root/sda b 8 0")
    assert r.exit_code != 0 and b"not permitted" in r.stderr, r
    # an overlay whiteout (char 0:0) is the one device node no capability guards: overlayfs
    # refuses to make one through the overlay
    r = sb.exec("mknod /root/wh c 0 0")
    assert r.exit_code != 0 and b"not permitted" in r.stderr, r
    # Root of a nested user namespace has every capability there, none over devices: the
    # kernel wants CAP_MKNOD in the initial namespace, on the writable layer and on a tmpfs
    # of its own alike.
    sb.write_file("/tmp/nested", nested_mknod_binary, mode=0o755)
    r = sb.exec("/tmp/nested")
    out = r.stdout.decode()
    assert r.exit_code == 0 and "uid=0" in out and "mounted" in out, r
    caps = int(out.split("CapEff:")[1].split()[0], 16)
    assert caps >> 27 & 1 and caps >> 21 & 1, out  # CAP_MKNOD and CAP_SYS_ADMIN, in there
    assert out.count("mknod /tmp/mem: Operation not permitted") == 2 and "made" not in out, out
    assert sb.exec("find / -xdev -type c -o -xdev -type b").stdout == b""
    sb.exec("touch /root/here").check()  # /root in the writable layer, to plant into
    upper, rootfs = _host_paths(dsec_node, sb.id)
    # The worst case, as if one had got there: a device node in the writable layer (planted by
    # root on the host here). It opens neither from the host, even for root, nor inside.
    os.mknod(upper / "root" / "zero", 0o666 | 0o020000, os.makedev(1, 5))
    for path in (upper / "root" / "zero", rootfs / "root" / "zero"):
        with pytest.raises(PermissionError):
            open(path, "rb").close()  # nodev: EACCES
    r = sb.exec("head -c 4 /root/zero | wc -c")
    assert r.stdout.strip() == b"0" and b"denied" in r.stderr, r
