"""apparmor_parser, the one program that compiles AppArmor profiles: checking a profile without a
kernel (parse-only) and loading one into the kernel, both refusing a profile with a rule the
kernel would not enforce."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from dsec_core.linux.tools import run_tool

__all__ = ["PARSER", "STRICT", "check_profile", "find_parser", "load_profile"]

PARSER = "apparmor_parser"
# Debian's apparmor package puts it in /sbin; a daemon started without sbin on its PATH still
# finds it there.
SBIN = ("/usr/sbin", "/sbin")
#: Turn the parser's warnings that a rule is downgraded ("extended network unix socket rule to
#: generic network rule") or not enforced by the kernel into errors: apparmor 3.0 files those
#: under its "dev" warnings. A strict profile that would load with a rule dropped fails. Only
#: profiles that need unix socket mediation are strict: on a kernel without it, the parser
#: downgrades a bare ``network,`` rule too (harmlessly: it allowed every unix socket anyway).
STRICT = ("--warn=dev", "--Werror=dev")
TIMEOUT = 60.0


def find_parser() -> str | None:
    """The path of apparmor_parser, or None if it is not installed."""
    return shutil.which(PARSER) or shutil.which(PARSER, path=os.pathsep.join(SBIN))


def _parser() -> str:
    # run_tool turns a missing program into a ToolError that says so
    return find_parser() or PARSER


def check_profile(text: str, kernel_features: Path | None = None, strict: bool = False) -> None:
    """Compile ``text`` without loading it (``-Q``, skip kernel load; ``-K``, no cache);
    ``ToolError`` with the parser's message if it does not compile (or, ``strict``, if it
    warns). ``kernel_features`` (a features file, like Debian's
    ``/usr/share/apparmor-features/features``) stands for the kernel it is compiled for;
    without it, the running kernel's, or none."""
    argv = [_parser(), "-Q", "-K", *(STRICT if strict else ())]
    if kernel_features is not None:
        argv += ["--kernel-features", os.fspath(kernel_features)]
    run_tool(argv, "apparmor_parser: checking a profile", input=text, timeout=TIMEOUT)


def load_profile(path: Path, cache_dir: Path, strict: bool = False) -> None:
    """Load (or replace, ``-r``) the profile in file ``path`` into the kernel, keeping its
    compiled form in ``cache_dir`` (``-W``, ``-L``) rather than the system's cache;
    ``ToolError`` if the parser refuses it (or, ``strict``, warns)."""
    argv = [_parser(), "-r", "-W", "-L", os.fspath(cache_dir), *(STRICT if strict else ())]
    argv.append(os.fspath(path))
    run_tool(argv, f"apparmor_parser: loading profile {path.name}", timeout=TIMEOUT)
