"""pytest fixtures for testing dsec and its plugins against a real, isolated node daemon.

Opt-in, as pytester is: ``-p dsec_core.testing`` on the command line (or ``addopts``), or
``pytest_plugins = ["dsec_core.testing"]`` in the rootdir's conftest.py. A third-party plugin's
tests then get the fixtures ours use: ``dsec_node`` (a daemon in a private home with a busybox
base layer ``kit-base@1``), ``dsec_client``, ``dsec_backend_name`` (the backend the kit's
sandboxes use: the test class's ``backend_name``) and ``dsec_sandboxes`` (creates sandboxes and
kills every one of them at teardown).

Where the kit's nodes live: each gets a fresh directory ``dsec-kit-*``, removed afterwards,
inside ``DSEC_KIT_HOME`` if that is set, else inside ``DSEC_HOME`` if that is set, else in the
system's temporary directory. Sandboxes' unprivileged root must be able to enter every parent
of that directory (``NodeConfig.ensure_dirs`` refuses otherwise).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shutil
import stat
import subprocess
import tempfile
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from ..backend import cgroup_path
from ..catalog.model import Catalog, Environment
from ..catalog.store import CatalogStore
from ..config import NodeConfig
from ..errors import DsecError, InvalidSpec, NodeUnavailable
from ..layers.build import build_layer
from ..layers.store import LayerStore
from ..linux.loop import loop_backing_files
from ..linux.mounts import mounted_under, unmount
from ..localnode import daemon_pid, ensure_daemon, stop_daemon
from ..records import LayerInfo, SandboxSpec
from ..sdk import Client

__all__ = [
    "KIT_DEVICE_KIND",
    "KitNode",
    "SandboxRecorder",
    "build_busybox_layer",
    "cgroup_hierarchies",
    "daemon_config",
    "kit_home_parent",
    "leaves_no_mounts_or_threads",
    "leftovers",
    "make_busybox_rootfs",
    "make_standin_device",
    "node_home",
    "running_kit_node",
]

BUSYBOX = "/bin/busybox"
CGROUP_ROOT = Path("/sys/fs/cgroup")


def kit_home_parent() -> Path:
    """Where the kit makes its nodes' homes: ``DSEC_KIT_HOME``, else ``DSEC_HOME``, else the
    system's temporary directory."""
    for var in ("DSEC_KIT_HOME", "DSEC_HOME"):
        if os.environ.get(var):
            return Path(os.environ[var])
    return Path(tempfile.gettempdir())


def cgroup_hierarchies() -> list[Path]:
    """Every cgroup hierarchy mounted under /sys/fs/cgroup: the root itself on cgroup v2, each
    controller's directory (and ``unified``) on v1 and hybrid hosts. Symlinked aliases such as
    ``cpu`` -> ``cpu,cpuacct`` are listed once."""
    if not CGROUP_ROOT.is_dir():
        return []
    if (CGROUP_ROOT / "cgroup.controllers").exists():
        return [CGROUP_ROOT]
    return sorted(d for d in CGROUP_ROOT.iterdir() if d.is_dir() and not d.is_symlink())


def make_busybox_rootfs(root: Path) -> Path:
    """A minimal root filesystem: static busybox with all its applets, and the usual dirs."""
    if not Path(BUSYBOX).exists():
        pytest.skip("busybox-static is not installed (apt-get install busybox-static)")
    for d in (
        "bin",
        "sbin",
        "usr/bin",
        "usr/sbin",
        "etc",
        "root",
        "tmp",
        "proc",
        "sys",
        "dev",
        "var/tmp",
        "home",
    ):
        (root / d).mkdir(parents=True, exist_ok=True)
    os.chmod(root / "tmp", 0o1777)
    shutil.copy2(BUSYBOX, root / "bin" / "busybox")
    applets = subprocess.run(
        [BUSYBOX, "--list-full"], capture_output=True, text=True, check=True
    ).stdout.split()
    for applet in applets:
        link = root / applet
        if not link.exists() and not link.is_symlink():
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to("/bin/busybox")
    (root / "etc" / "passwd").write_text(
        "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n"
    )
    (root / "etc" / "group").write_text("root:x:0:\nnogroup:x:65534:\n")
    return root


def build_busybox_layer(store: LayerStore, name: str = "kit-base", version: str = "1") -> LayerInfo:
    """Build ``make_busybox_rootfs`` as base layer ``name@version`` into ``store``."""
    with tempfile.TemporaryDirectory() as tmp:
        rootfs = make_busybox_rootfs(Path(tmp) / "rootfs")
        return build_layer(rootfs, name=name, version=version, kind="base", store=store)


def daemon_config(home: Path, **settings: Any) -> NodeConfig:
    """The ``NodeConfig`` a node daemon started in ``home`` from this process's environment
    reads (``NodeConfig.from_env``, ``home`` for ``DSEC_HOME``), ``settings`` on top: what a test
    compares with the daemon's own view (its uid ranges, ``DSEC_UID_BASE`` per test worker)."""
    return dataclasses.replace(NodeConfig.from_env(), home=home, **settings)


@contextlib.contextmanager
def node_home(prefix: str = "dsec-node-", **settings: Any) -> Iterator[NodeConfig]:
    """The config of a fresh node home in ``/tmp`` (``NodeConfig`` ``settings`` on top) with
    the busybox layer ``kit-base@1`` in its store, for a ``Node`` driven in-process; on exit
    the home is removed, and anything the node left behind fails the caller."""
    home = Path(tempfile.mkdtemp(prefix=prefix))
    config = daemon_config(home, **settings)
    config.ensure_dirs()
    build_busybox_layer(LayerStore(config.layer_dir))
    try:
        yield config
    finally:
        left = leftovers(home)
        shutil.rmtree(home, ignore_errors=True)
        assert not any(left.values()), left


def _starting_init(cmdline: bytes, live: Sequence[str]) -> bool:
    """Whether ``cmdline`` is an OCI runtime's ``run`` of one of the ``live`` sandboxes."""
    args = [a for a in cmdline.split(b"\0") if a]
    return b"run" in args and args[-1].decode(errors="replace") in live


def leftovers(home: Path) -> dict[str, list[str]]:
    """What a node under ``home`` left behind: mounts, cgroups (its sandboxes', those whose
    directories are here and those its daemon's log names, and its daemon's once no daemon
    runs), sandbox dirs, processes (but, while its daemon runs, the daemon and
    the helpers whose pid files are in ``run/``, such as the container backend's lxcfs), loop
    devices bound to files under ``home``, and sandboxes' disk images.

    A live sandbox's init before it runs the agent is not a leftover: a create returns once
    the runtime has started it, and until its exec it carries the runtime's command line
    (crun's names the home; runc's init did not). A runtime's ``run`` of a sandbox whose
    directory is still here is taken for that; once the directory is gone, it is reported."""
    prefix = os.fspath(home)
    mounts = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            mp = line.split()[4]
            if mp.startswith(prefix):
                mounts.append(mp)
    dirs = sorted(
        {
            p.name
            for sdir in (home / "sandboxes", home / "run" / "sandboxes")
            if sdir.exists()
            for p in sdir.iterdir()
        }
    )
    cgroups = []
    config = NodeConfig(home=home)
    # a running daemon's own cgroups are in use, not left behind
    daemon_cgroup = None if daemon_pid(config) else config.daemon_cgroup
    # a sandbox's cgroups may outlive its directory (a stop that found them busy): those of
    # the sandboxes the log names (killed, cleaned up) are this node's too; ids never recur
    named = sorted(set(dirs) | _logged_sandboxes(config.log_path))
    for hier in cgroup_hierarchies():
        for sid in named:
            if (hier / cgroup_path(sid)).exists():
                cgroups.append(os.fspath(hier / cgroup_path(sid)))
        if daemon_cgroup and (hier / daemon_cgroup).exists():
            cgroups.append(os.fspath(hier / daemon_cgroup))
    procs = []
    helpers = _helper_pids(config.run_dir) if daemon_pid(config) else set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or pid in helpers:
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if _names(cmd, prefix.encode()) and b"dsec_core.node.daemon" not in cmd:
            if _starting_init(cmd, dirs):
                continue
            shown = cmd.replace(b"\0", b" ").decode(errors="replace")
            procs.append(f"{pid}: {shown}")
    loops = [f"{dev}: {backing}" for dev, backing in loop_backing_files(home).items()]
    disk_dir = home / "disks"
    images = sorted(p.name for p in disk_dir.glob("*.img")) if disk_dir.is_dir() else []
    if not daemon_pid(config):  # a running node may be deleting some in the background
        images += sorted(f"freeing/{p.name}" for p in disk_dir.glob("freeing/*.img"))
    return {
        "mounts": mounts,
        "sandbox_dirs": dirs,
        "cgroups": cgroups,
        "processes": procs,
        "loop_devices": loops,
        "disk_images": images,
    }


#: The id of a sandbox a daemon's log line says it killed or cleaned up ("killing sandbox
#: 0123456789ab-n2 (...)", "sandbox ... died on its own; cleaning up"), not one it names for
#: another reason (a parent of a restore may be another node's).
_LOGGED_SANDBOX = re.compile(
    rb'(?:killing |gone |"msg": ")sandbox ([0-9a-f]{12}(?:-[A-Za-z0-9_.]+(?:-[A-Za-z0-9_.]+)*)?)'
)


def _logged_sandboxes(log_path: Path) -> set[str]:
    """The ids of the sandboxes a daemon's log (with its rotated files) names."""
    ids: set[str] = set()
    for path in (log_path, *sorted(log_path.parent.glob(log_path.name + ".*"))):
        with contextlib.suppress(OSError):
            ids.update(m.decode() for m in _LOGGED_SANDBOX.findall(path.read_bytes()))
    return ids


def _names(cmd: bytes, prefix: bytes) -> bool:
    """Whether a command line names a path under ``prefix``, other than as a path another
    node's runtime launcher hides (``--hide``/``--mask`` list every mount on the host, other
    nodes' homes included)."""
    args = cmd.split(b"\0")
    hidden = {i + 1 for i, a in enumerate(args) if a in (b"--hide", b"--mask")}
    return any(prefix in a for i, a in enumerate(args) if i not in hidden)


def _helper_pids(run_dir: Path) -> set[str]:
    """The pids in the pid files (``*.pid``) of a node's runtime directory."""
    pids = set()
    for path in run_dir.glob("*.pid") if run_dir.is_dir() else ():
        with contextlib.suppress(OSError):
            pids.add(path.read_text().strip())
    return pids


@contextlib.contextmanager
def leaves_no_mounts_or_threads(tmp_path: Path, *thread_prefixes: str) -> Iterator[None]:
    """Fail the test if, after the block, anything is mounted under ``tmp_path`` or a thread
    whose name starts with one of ``thread_prefixes`` is still running."""
    before = set(threading.enumerate())
    yield
    assert mounted_under(tmp_path) == []
    with open("/proc/mounts") as f:
        assert str(tmp_path) not in f.read()
    leftover = [
        t
        for t in set(threading.enumerate()) - before
        if t.is_alive() and t.name.startswith(thread_prefixes)
    ]
    assert leftover == []


#: The device kind of the kit node's inventory: one stand-in device node (``KitNode.device``).
KIT_DEVICE_KIND = "kit-null"


def make_standin_device(name: str = "null", major: int = 1, minor: int = 3) -> Path:
    """A char device node ``major``:``minor`` (default: /dev/null's numbers), mode 0666, in a
    fresh directory under the host's /dev (mode 0755: runc's init, an unprivileged host uid,
    walks to it to bind it into a sandbox). A stand-in for an accelerator on hosts without
    one; remove its directory when done."""
    d = Path(tempfile.mkdtemp(prefix="dsec-kit-devices-", dir="/dev"))
    try:
        d.chmod(0o755)
        path = d / name
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(major, minor))
        path.chmod(0o666)  # past the umask
    except BaseException:
        shutil.rmtree(d, ignore_errors=True)
        raise
    return path


@dataclass
class KitNode:
    """A node daemon in a private ``DSEC_HOME`` with a busybox base layer ``kit-base@1`` and,
    where the kit can make one, a stand-in device of kind ``KIT_DEVICE_KIND`` (``device``,
    /dev/null's numbers) in its inventory; ``env`` is what the daemon gets besides
    ``DSEC_HOME``."""

    home: Path
    config: NodeConfig
    layer: LayerInfo
    env: dict[str, str] = field(default_factory=dict)
    device: Path | None = None

    @classmethod
    def start(cls, home: Path) -> KitNode:
        config = daemon_config(home)
        config.ensure_dirs()
        layer = build_busybox_layer(LayerStore(config.layer_dir))
        try:
            device: Path | None = make_standin_device()
        except OSError:  # no /dev to write to: the devices check skips, saying so
            device = None
        env = {"DSEC_DEVICES": f"{KIT_DEVICE_KIND}={device}"} if device else {}
        node = cls(home=home, config=config, layer=layer, env=env, device=device)
        try:
            node._ensure_daemon()
        except BaseException:
            node._remove_device()
            raise
        return node

    def _ensure_daemon(self) -> None:
        """``ensure_daemon`` with ``DSEC_HOME`` and ``env`` in the environment it inherits."""
        extra = {"DSEC_HOME": os.fspath(self.home), **self.env}
        saved = {k: os.environ.get(k) for k in extra}
        os.environ.update(extra)
        try:
            ensure_daemon(self.config)
        finally:
            for key, old in saved.items():
                if old is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = old

    def _remove_device(self) -> None:
        if self.device is not None:
            shutil.rmtree(self.device.parent, ignore_errors=True)

    def client(self) -> Client:
        return Client(os.fspath(self.config.socket_path))

    def environment(self, name: str) -> str:
        """Save a catalog ``name`` holding one environment ``name``, the kit's busybox base
        alone, where the daemon reads catalogs; returns the name to create or call it by."""
        CatalogStore(self.config.catalog_dir).save(
            Catalog(name=name, environments=(Environment(name=name, base=self.layer.ref),))
        )
        return name

    def daemon_rss(self) -> int:
        """The node daemon's resident memory in bytes (VmRSS), for checks that it stays
        bounded while clients misbehave."""
        pid = daemon_pid(self.config)
        if pid is None:
            raise NodeUnavailable(f"no node daemon runs for {self.home}")
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise NodeUnavailable(f"daemon {pid} shows no VmRSS")

    def ensure_running(self) -> None:
        """Start the daemon again if a test stopped it."""
        if daemon_pid(self.config) is None:
            self._ensure_daemon()

    def restart(self) -> None:
        """Stop the daemon (its sandboxes keep running) and start a new one, which re-adopts
        them. The new daemon inherits this process's environment, as the first one did."""
        stop_daemon(self.config)
        self._ensure_daemon()

    def stop(self) -> None:
        """Kill every sandbox and stop the daemon (starting it first if a test stopped it)."""
        self.ensure_running()
        try:
            with self.client() as c:
                for info in c.list():
                    try:
                        c.kill(info.id)
                    except DsecError:
                        pass
        except DsecError:
            pass
        stop_daemon(self.config)
        self._remove_device()


class SandboxRecorder:
    """Creates sandboxes for a test and remembers them, so teardown can kill every one."""

    def __init__(self, client: Client, default_spec: dict[str, Any]) -> None:
        self.client = client
        self.default_spec = default_spec
        self.created: list[str] = []

    def spec(self, **kw: Any) -> SandboxSpec:
        return SandboxSpec(**{**self.default_spec, **kw})

    def create(self, **kw: Any):
        sb = self.client.create(self.spec(**kw))
        self.created.append(sb.id)
        return sb

    def create_many(self, n: int, **kw: Any):
        sbs = self.client.create_many(self.spec(**kw), n)
        self.created.extend(sb.id for sb in sbs)
        return sbs

    def cleanup(self) -> None:
        for sid in self.created:
            try:
                self.client.kill(sid)
            except DsecError:
                pass


@contextlib.contextmanager
def running_kit_node(prefix: str = "dsec-kit-") -> Iterator[KitNode]:
    """A ``KitNode`` in a fresh home ``<kit_home_parent()>/<prefix>*``; on exit everything is
    stopped and removed, and anything the node left behind (mounts, cgroups, dirs, processes)
    fails the caller."""
    parent = kit_home_parent()
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InvalidSpec(
            f"the kit cannot make its node home in {parent}: {e} (set "
            "DSEC_KIT_HOME to a writable directory)",
            path=os.fspath(parent),
        ) from e
    home = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    try:
        node = KitNode.start(home)
    except BaseException:  # a daemon that would not start: leave nothing of it either
        with contextlib.suppress(DsecError):
            stop_daemon(NodeConfig(home=home))
        for mp in sorted(mounted_under(home), key=lambda p: len(os.fspath(p)), reverse=True):
            with contextlib.suppress(OSError, DsecError):
                unmount(mp)
        shutil.rmtree(home, ignore_errors=True)
        raise
    try:
        yield node
    finally:
        node.stop()
        left = leftovers(home)
        shutil.rmtree(home, ignore_errors=True)
        assert not any(left.values()), f"the node left things behind: {left}"


@pytest.fixture(scope="session")
def dsec_node() -> Iterator[KitNode]:
    """A real node daemon in a temporary DSEC_HOME, shared by the test session."""
    if os.geteuid() != 0:
        pytest.skip("a dsec node needs root")
    with running_kit_node() as node:
        yield node


@pytest.fixture
def dsec_client(dsec_node: KitNode) -> Iterator[Client]:
    with dsec_node.client() as client:
        yield client


@pytest.fixture
def dsec_backend_name(request) -> str:
    """The backend the kit's sandboxes use: the test class's ``backend_name``. Tests outside
    such a class override this fixture (there is no default backend)."""
    name = getattr(request.instance, "backend_name", None)
    if not name:
        pytest.fail(
            f"{request.node.nodeid}: dsec_sandboxes needs a backend; set "
            '`backend_name = "<backend>"` on the test class, or override the '
            "`dsec_backend_name` fixture in the module or its conftest.py",
            pytrace=False,
        )
    return name


@pytest.fixture
def dsec_sandboxes(
    dsec_client: Client, dsec_node: KitNode, dsec_backend_name: str, request
) -> Iterator[SandboxRecorder]:
    """Create sandboxes with ``dsec_sandboxes.create(**spec)``; all are killed at teardown.

    The default spec uses the kit's busybox layer, ``dsec_backend_name``, and the fields of
    the test class's ``sandbox_spec`` (if any) on top.
    """
    extra = dict(getattr(request.instance, "sandbox_spec", None) or {})
    rec = SandboxRecorder(
        dsec_client,
        {
            "layers": (dsec_node.layer.ref,),
            "backend": dsec_backend_name,
            "cpu": 1.0,
            "memory": "256M",
            "pids": 256,
            "ttl": 600,
            **extra,
        },
    )
    try:
        yield rec
    finally:
        rec.cleanup()
