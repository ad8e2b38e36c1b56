"""gVisor (``runsc``) as the container backend's second OCI runtime: the same bundle, run on
gVisor's user-space kernel (the Sentry) instead of the host's.

What differs from runc, and why:

- runsc (2022 and later Debian builds) cannot pass descriptors beyond stdio, so the agent binds
  its own listening socket (``dsec-agent --listen``) in a per-sandbox host directory mounted at
  ``UDS_DIR`` (``--host-uds=all``: gVisor's gofer creates it on the host and hands the Sentry
  the connections); ``rt.agent_socket`` is a symlink to it. The policy document and the
  agent's answer share one socketpair at the agent's stdin, which runsc does pass.
- The platform is ``kvm`` only where hardware virtualisation really works (``kvm_usable``);
  else ``ptrace``, as on nested platforms such as PVM.
- ``--network=none``: gVisor's own network stack with loopback only. A network mode a policy
  would enforce on the host network namespace is refused: gVisor never uses that namespace.
- Each sandbox has its own ``--root`` state directory, so stopping it removes all of runsc's
  files by removing one directory; its gofer is killed by pid (read from that state).
- Host devices do not reach a gVisor sandbox (it implements /dev itself).
- The host's pids cgroup counts host tasks: the Sentry's and gofer's threads and one ptrace
  stub per address space, not the sandbox's processes; its limit is ``host_pids_limit`` of the
  spec's, so a fork bomb (a stub per process) is still bounded.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
from pathlib import Path
from typing import Any

from dsec_core.backend import AGENT_PATH, SandboxRuntime
from dsec_core.errors import PolicyUnavailable

__all__ = ["UDS_DIR", "GvisorChannel", "gofer_pid", "kvm_usable", "platform", "runsc_config"]

#: Where the agent binds its socket inside a gVisor sandbox (a host directory, bind-mounted).
UDS_DIR = "/.dsec/uds"
AGENT_SOCKET_NAME = "agent.sock"


def kvm_usable() -> bool:
    """Real hardware virtualisation: /dev/kvm opens, the CPU has VMX or SVM, and the KVM
    underneath is not PVM's (a paravirtualised nested KVM that gVisor's kvm platform cannot
    use)."""
    if Path("/sys/module/kvm_pvm").exists():
        return False
    try:
        os.close(os.open("/dev/kvm", os.O_RDWR | os.O_CLOEXEC))
    except OSError:
        return False
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            return bool(flags & {"vmx", "svm"})
    return False


def platform() -> str:
    return "kvm" if kvm_usable() else "ptrace"


def check_spec(rt: SandboxRuntime) -> None:
    """What a gVisor sandbox cannot be given, refused before anything starts."""
    if rt.spec.network != "none":
        raise PolicyUnavailable(
            f"sandbox {rt.id}: network {rt.spec.network!r} is not available under gVisor "
            "(runtime runsc runs with --network=none: its own stack, loopback only; network "
            "policies enforce on the host network namespace, which gVisor does not use)",
            policy="network",
            sandbox_id=rt.id,
        )
    if rt.devices:
        raise PolicyUnavailable(
            f"sandbox {rt.id}: host devices cannot be passed to a gVisor sandbox (runtime "
            "runsc implements /dev itself); use runtime runc for devices",
            policy="devices",
            sandbox_id=rt.id,
        )


#: Host tasks a gVisor sandbox may have beyond its processes' stubs: the Go runtime threads of
#: the Sentry (and ptrace's one OS thread per running task). 8 concurrent ``sleep``s already
#: took a sandbox past 256 host tasks at one moment.
PIDS_HEADROOM = 512


def host_pids_limit(pids: int) -> int:
    """The host pids limit of a gVisor sandbox allowed ``pids`` processes."""
    return 2 * pids + PIDS_HEADROOM


def check_oci(rt: SandboxRuntime, config: dict[str, Any]) -> None:
    """What policies put in the OCI config that runsc would not apply to the sandbox's
    processes, refused rather than claimed enforced: an AppArmor profile (runsc confines
    nothing with it; the Sentry's own syscall filter stands in its place)."""
    profile = config.get("process", {}).get("apparmorProfile")
    if profile:
        raise PolicyUnavailable(
            f"sandbox {rt.id}: AppArmor profile {profile!r} cannot be enforced under gVisor "
            "(runsc does not apply AppArmor profiles to the sandbox's processes: they run on "
            "its user-space kernel); use runtime runc, or the landlock policy on runc",
            policy="apparmor",
            sandbox_id=rt.id,
        )


def runsc_config(config: dict[str, Any], rt: SandboxRuntime, with_policy: bool) -> None:
    """Adapt runc's OCI config for runsc in place: the agent binds its socket in ``UDS_DIR``
    and reads its policy document (and answers) on its stdin."""
    args = [AGENT_PATH, "--listen", f"{UDS_DIR}/{AGENT_SOCKET_NAME}"]
    if with_policy:
        args += ["--policy-fd", "0", "--status-fd", "0"]
    config["process"]["args"] = args
    config["linux"]["resources"]["pids"]["limit"] = host_pids_limit(rt.limits.pids)
    config["mounts"].append(
        {
            "destination": UDS_DIR,
            "type": "bind",
            "source": os.fspath(uds_dir(rt)),
            "options": ["bind", "rw", "nosuid", "nodev", "noexec"],
        }
    )


def uds_dir(rt: SandboxRuntime) -> Path:
    return rt.dir / "uds"


def argv(
    runsc: str,
    root: Path,
    log: Path,
    pid_file: Path,
    rt: SandboxRuntime,
    platform_name: str,
    oci_seccomp: bool = False,
) -> list[str]:
    return [
        runsc,
        "--root",
        os.fspath(root),
        "--log",
        os.fspath(log),
        "--log-format",
        "json",
        f"--platform={platform_name}",
        "--network=none",
        # the agent's own socket and the drive socket: both in bind mounts of the sandbox's
        "--host-uds=all",
        # a seccomp filter in the OCI config is applied inside the Sentry only when asked
        *(["--oci-seccomp"] if oci_seccomp else []),
        "run",
        "--detach",
        "--pid-file",
        os.fspath(pid_file),
        "--bundle",
        os.fspath(rt.dir),
        rt.id,
    ]


def gofer_pid(root: Path) -> int | None:
    """The gofer's host pid from runsc's state under ``root`` (None if there is none). The
    gofer is reparented to the host's init, which reaps it once it is killed."""
    try:
        states = list(root.glob("*.state"))
    except OSError:
        return None
    for path in states:
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        pid = doc.get("goferPid", doc.get("GoferPid"))  # runsc writes goferPid
        if isinstance(pid, int) and pid > 0:
            return pid
    return None


class GvisorChannel:
    """The agent's socket and policy channel for one gVisor sandbox: the directory the agent
    binds in, the symlink at ``rt.agent_socket``, and with a document a socketpair whose
    other end is the agent's stdin (``stdin``)."""

    def __init__(self, rt: SandboxRuntime, document: bytes | None) -> None:
        self.rt = rt
        self.document = document
        self.stdin: int | None = None
        self.ours: socket.socket | None = None

    def __enter__(self) -> GvisorChannel:
        d = uds_dir(self.rt)
        d.mkdir(mode=0o700, exist_ok=True)
        # the gofer binds the agent's socket as the sandbox's root (its host uid)
        os.chown(d, self.rt.idmap.host_base, self.rt.idmap.root_gid)
        link = self.rt.agent_socket
        with contextlib.suppress(FileNotFoundError):
            link.unlink()
        link.symlink_to(d / AGENT_SOCKET_NAME)
        if self.document is not None:
            self.ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            self.ours.sendall(self.document)
            self.ours.shutdown(socket.SHUT_WR)  # the agent reads its document to EOF
            self.stdin = theirs.detach()
        return self

    def close_inherited(self) -> None:
        if self.stdin is not None:
            os.close(self.stdin)
            self.stdin = None

    def answer_fd(self) -> int:
        return -1 if self.ours is None else self.ours.fileno()

    def __exit__(self, *exc: object) -> None:
        self.close_inherited()
        if self.ours is not None:
            self.ours.close()
            self.ours = None

    @property
    def socket_path(self) -> Path:
        return uds_dir(self.rt) / AGENT_SOCKET_NAME
