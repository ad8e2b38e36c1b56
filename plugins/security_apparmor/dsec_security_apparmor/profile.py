"""A sandbox's file policy (``FileRules``) rendered as an AppArmor profile: a base in the style of
Docker's ``docker-default`` plus ``deny`` rules for the protected paths, named by a hash of its
text so that equal settings share one profile and different settings never replace each other.

The base allows what a container normally needs (files, network, capabilities, umount) and, as
docker-default does, denies mounts, writes into ``/proc`` outside the sandbox's own processes
and ``/proc/sys/kernel/shm*``, writes into ``/sys`` outside cgroupfs, and every access to
``/proc/kcore``, ``/proc/sysrq-trigger``, ``/sys/firmware`` and ``/sys/kernel/security``;
dsec adds ``/proc/kpage*`` (a recursive read of ``/proc/kpagecgroup`` crashed a kernel under
DSec). ptrace stays within the profile. AppArmor ``deny`` rules win over every allow rule,
so the protected paths are carved out of the broad ``file,`` grant (Landlock, which only adds
grants, needs the opposite shape).

Paths from settings are literal: every character AppArmor reads as a pattern (``*?[]{}``,
``@{`` variables, ``\\``, ``^``) is escaped, and every byte outside printable ASCII is written
as an octal escape, so a path can never match more than itself (``quote``).
"""

from __future__ import annotations

import hashlib
import posixpath
from dataclasses import dataclass

from dsec_core.security import FileRules

__all__ = ["ABI", "PROFILE_PREFIX", "Profile", "ancestors", "quote", "render"]

#: The policy ABI the profiles are written against (``/etc/apparmor.d/abi/3.0``, shipped with
#: apparmor 3.0 and later): it names the rule classes the profile uses, so the parser compiles
#: them for any kernel that has them instead of the distribution's pinned feature set.
ABI = "abi/3.0"
PROFILE_PREFIX = "dsec-"
HASH_HEX = 12

# Characters AppArmor's path patterns give a meaning: globs, alternations, character classes,
# variables (@{...}), the escape itself, the quote that ends the string.
SPECIAL = frozenset('*?[]{}^\\"@')

#: What ``read_only`` denies: writing (which covers appending, creating, removing, renaming and
#: changing attributes: AppArmor maps them all to ``w``) and making hard links there.
READ_ONLY_PERMS = "wl"
#: What ``hidden`` denies: everything, reading, mapping and running included.
HIDDEN_PERMS = "rwlkmx"

# Socket families for `network` rules when abstract unix sockets are scoped: AppArmor maps a
# bare `network,` (or `network unix,`) onto every unix socket rule, which would allow what the
# scope's `unix` rules leave out. Families the kernel knows and this list does not are denied.
FAMILIES = (
    "inet inet6 netlink packet alg vsock ax25 ipx appletalk netrom bridge atmpvc x25 rose "
    "netbeui security key ash econet atmsvc rds sna irda pppox wanpipe llc ib mpls can tipc "
    "bluetooth iucv rxrpc isdn phonet ieee802154 caif nfc kcm qipcrtr smc xdp"
).split()

# docker-default's denials (profiles/apparmor/template.go in moby), with /proc spelled out
# rather than @{PROC} so the profile needs no tunables from /etc/apparmor.d.
BASE_DENIALS = """\
  deny mount,
  deny pivot_root,

  deny /proc/* w,   # files directly in /proc
  # anything in /proc but /proc/<pid>/** and /proc/sys/**
  deny /proc/{[^1-9],[^1-9][^0-9],[^1-9s][^0-9y][^0-9s],[^1-9][^0-9][^0-9][^0-9/]*}/** w,
  deny /proc/sys/[^k]** w,   # /proc/sys but /proc/sys/kernel
  deny /proc/sys/kernel/{?,??,[^s][^h][^m]**} w,   # /proc/sys/kernel but shm*
  deny /proc/sysrq-trigger rwklx,
  deny /proc/kcore rwklx,
  deny /proc/kpage* rwklx,

  deny /sys/[^f]*/** wklx,
  deny /sys/f[^s]*/** wklx,
  deny /sys/fs/[^c]*/** wklx,
  deny /sys/fs/c[^g]*/** wklx,
  deny /sys/fs/cg[^r]*/** wklx,
  deny /sys/firmware/** rwklx,
  deny /sys/devices/virtual/powercap/** rwklx,
  deny /sys/kernel/security/** rwklx,
"""


@dataclass(frozen=True)
class Profile:
    """A rendered profile: its ``name`` (``dsec-<12 hex>``), the ``text`` apparmor_parser
    reads, and whether it must be compiled ``strict`` (its unix rules scope abstract sockets:
    a kernel that would drop them must refuse the profile)."""

    name: str
    text: str
    strict: bool = False


def quote(path: str) -> str:
    """``path`` as a double-quoted AppArmor path that matches that path and nothing else."""
    out = []
    for byte in path.encode("utf-8", "surrogateescape"):
        ch = chr(byte)
        if ch in SPECIAL:
            out.append("\\" + ch)
        elif 0x20 <= byte < 0x7F:
            out.append(ch)
        else:  # newlines, control bytes, UTF-8: a three-digit octal escape is exactly one byte
            out.append(f"\\{byte:03o}")
    return '"' + "".join(out) + '"'


def ancestors(path: str) -> list[str]:
    """The directories above ``path``, ``/`` excluded, outermost first."""
    out = []
    parent = posixpath.dirname(path)
    while parent not in ("/", ""):
        out.append(parent)
        parent = posixpath.dirname(parent)
    return out[::-1]


def _quote_tree(path: str) -> str:
    # The path itself (a file, or a directory named without its slash) and everything beneath
    # (`/**` also matches the directory as AppArmor names it, with a trailing slash).
    return quote(path)[:-1] + '{,/**}"'


def _quote_node(path: str) -> str:
    # The entry itself, as a file or as a directory (trailing slash), nothing beneath.
    return quote(path)[:-1] + '{,/}"'


def _network(rules: FileRules) -> list[str]:
    if "abstract_unix" not in rules.scope:
        return ["  network,"]
    per_line = 6
    return [
        "  # network families but unix: a bare `network,` would allow every unix socket",
        *(
            "  " + " ".join(f"network {f}," for f in FAMILIES[i : i + per_line])
            for i in range(0, len(FAMILIES), per_line)
        ),
        "  # unix sockets: anonymous ones, and abstract ones only with processes of this",
        "  # profile (sockets bound to a path are mediated by the file rules)",
        "  unix (create, bind, listen, shutdown, getattr, setattr, getopt, setopt),",
        "  unix (connect, send, receive, accept) peer=(addr=none),",
        "  unix (connect, send, receive, accept) peer=(label=@{profile_name}),",
    ]


def _signal(rules: FileRules) -> list[str]:
    if "signal" not in rules.scope:
        return ["  signal,"]
    return [
        "  # signals only among the sandbox's processes, and from the host (the node and runc,",
        "  # unconfined or under a profile of that name, stop the sandbox)",
        "  signal (send, receive) peer=@{profile_name},",
        "  signal (receive) peer=unconfined,",
        "  signal (receive) peer=runc,",
        "  signal (receive) peer=crun,",
    ]


def _file_rules(rules: FileRules) -> list[str]:
    lines: list[str] = []
    protected = [*rules.read_only, *rules.hidden]
    if protected:
        # Renaming or removing a directory above a protected path would move the path out from
        # under its rules (AppArmor matches paths, not inodes), so the ancestors themselves
        # (not what else they hold) cannot be written either.
        above = sorted({a for p in protected for a in ancestors(p)})
        lines += ["", "  # the directories above protected paths: no renaming or removing them"]
        lines += [f"  deny {_quote_node(a)} w," for a in above]
    if rules.read_only:
        lines += ["", "  # read_only: reading and running stay allowed"]
        lines += [f"  deny {_quote_tree(p)} {READ_ONLY_PERMS}," for p in rules.read_only]
    if rules.hidden:
        lines += ["", "  # hidden: nothing at all"]
        lines += [f"  deny {_quote_tree(p)} {HIDDEN_PERMS}," for p in rules.hidden]
    return lines


def _body(rules: FileRules) -> str:
    lines = [
        "  # what a container normally needs",
        *_network(rules),
        "  capability,",
        "  file,",
        "  umount,",
        *_signal(rules),
        "  # the sandbox's processes may trace and read each other (ps, gdb), nothing else",
        "  ptrace (trace, read, tracedby, readby) peer=@{profile_name},",
        "",
        BASE_DENIALS.rstrip("\n"),
        *_file_rules(rules),
    ]
    return "\n".join(lines) + "\n"


def _summary(rules: FileRules) -> str:
    parts = [
        f"{key}={','.join(value)}"
        for key, value in (
            ("read_only", rules.read_only),
            ("hidden", rules.hidden),
            ("scope", rules.scope),
        )
        if value
    ]
    # the comment is one line: a path with a newline is shown escaped
    return " ".join(parts).encode("unicode_escape").decode("ascii") or "no file rules"


def render(rules: FileRules) -> Profile:
    """The profile for ``rules``; equal rules give the same name and text."""
    body = _body(rules)
    name = PROFILE_PREFIX + hashlib.sha256(body.encode()).hexdigest()[:HASH_HEX]
    text = (
        f"# {name}: dsec sandbox profile, rendered by dsec_security_apparmor; do not edit\n"
        f"# {_summary(rules)}\n"
        f"abi <{ABI}>,\n\n"
        f"profile {name} flags=(attach_disconnected,mediate_deleted) {{\n"
        f"{body}}}\n"
    )
    return Profile(name=name, text=text, strict="abstract_unix" in rules.scope)
