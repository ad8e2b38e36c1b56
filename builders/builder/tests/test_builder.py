"""The builder end to end on a real node: sessions, tools, plans, finish (scrub, pack, QA,
publish), and what goes wrong (a failing QA, a leak, a dead session, bad tool calls)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from dsec_builder import (
    BuildPolicy,
    BuildSession,
    BuildSessionLost,
    BuildToolError,
    BuildTools,
    QAFailed,
    TaskSpec,
    run_plan,
    run_task,
)
from dsec_builder.record import BuildStore
from dsec_builder.tools import check_args

from dsec_core.catalog.store import CatalogStore
from dsec_core.errors import InvalidSpec, LeakFound, UnknownEnvironment
from dsec_core.layers.store import LayerStore
from dsec_core.linux.processes import stop_process
from dsec_core.records import BUILD_LABEL, BUILD_NOTES_DIR, STAGED_PREFIX, LayerRef
from dsec_core.sdk import Client

WORKSPACE = "/workspace/adder"
STUB = "def add(a, b):\n    raise NotImplementedError\n"
REFERENCE = "def add(a, b):\n    # the reference solution of the adder task\n    return a + b\n"
HIDDEN_TEST = (
    "from adder import add\n\n\n"
    "def test_adds_two_numbers_including_negative_ones():\n"
    "    assert add(2, 3) == 5 and add(-7, 4) == -3\n"
)


IMPORTS = f"cd {WORKSPACE} && python3 -c 'import adder'"


def _task(**over):
    task = {
        "name": "adder",
        "command": f"cd {WORKSPACE} && python3 -m pytest -q -p no:cacheprovider",
        "reward": "exit_code",
        "timeout": 120,
        "tests": {f"{WORKSPACE}/test_hidden.py": {"file": f"{BUILD_NOTES_DIR}/test_hidden.py"}},
        "reference": {f"{WORKSPACE}/adder.py": REFERENCE},
    }
    task.update(over)
    return task


def _workspace(tools: BuildTools) -> None:
    """A small task workspace and (in the builder's notes) its hidden test, via the tools."""
    assert (
        tools.call("exec", {"command": f"mkdir -p {WORKSPACE} {BUILD_NOTES_DIR}"})["exit_code"] == 0
    )
    tools.call("write", {"path": f"{WORKSPACE}/adder.py", "content": STUB})
    tools.call("write", {"path": f"{BUILD_NOTES_DIR}/test_hidden.py", "content": HIDDEN_TEST})


def tools_ifaces(ctx, sid: str) -> list[str]:
    """The network interfaces a sandbox sees."""
    return ctx.client.exec(sid, "ls /sys/class/net").text.split()


def _layers(ctx) -> set[str]:
    return {i.ref for i in LayerStore(ctx.config.layer_dir).list()}


# --- pure logic ----------------------------------------------------------------------------


def test_policy_maps_indexes_to_egress_rules_and_mirror_env():
    none = BuildPolicy.from_dict(None)
    assert (none.network, none.policies, none.mirror_env()) == ("none", {}, {})
    pol = BuildPolicy.from_dict(
        {"indexes": [{"pip": "http://127.0.0.1:8123/simple"}, {"apt": "https://10.0.0.5/debian"}]}
    )
    assert pol.network == "allowlist"
    assert pol.policies == {"egress": {"allow": ["10.0.0.5:443/tcp", "127.0.0.1:8123/tcp"]}}
    assert pol.mirror_env()["PIP_INDEX_URL"] == "http://127.0.0.1:8123/simple"
    for bad in (
        {"indexes": [{"npm": "http://x"}]},
        {"indexes": [{"pip": "ftp://x/simple"}]},
        {"indexes": [{"pip": "http://x:99999/"}]},
        {"indexes": "http://x"},
        {"mirrors": []},
    ):
        with pytest.raises(InvalidSpec):
            BuildPolicy.from_dict(bad)


def test_tool_arguments_are_checked_against_the_signature():
    tools = BuildTools.__new__(BuildTools)
    check_args("exec", tools.exec, {"command": "ls", "timeout": 5})
    with pytest.raises(BuildToolError, match="unknown argument"):
        check_args("exec", tools.exec, {"command": "ls", "shell": "zsh"})
    with pytest.raises(BuildToolError, match="missing"):
        check_args("write", tools.write, {"path": "/x"})
    with pytest.raises(BuildToolError, match="'timeout' must be"):
        check_args("exec", tools.exec, {"command": "ls", "timeout": "soon"})
    with pytest.raises(BuildToolError, match="unknown tool"):
        tools.method("rm_rf")


# --- on a real node ------------------------------------------------------------------------


def test_whole_build_publishes_a_task_environment(ctx, python_node):
    session = BuildSession.start(ctx, from_env="python", name="adder", version="1")
    sid = session.sandbox_id
    info = ctx.client.get(sid).info
    assert info.labels[BUILD_LABEL] == "adder" and info.environment == "python"
    # no network without indexes: nothing but loopback inside
    assert "lo" in tools_ifaces(ctx, sid) and len(tools_ifaces(ctx, sid)) == 1
    tools = BuildTools(session)
    _workspace(tools)
    shell = tools.call("session_exec", {"command": f"cd {WORKSPACE} && export X=41"})
    again = tools.call("session_exec", {"command": "pwd; echo $((X+1))"})
    assert again["session"] == shell["session"] and again["stdout"] == f"{WORKSPACE}\n42\n"
    assert tools.call("read", {"path": f"{WORKSPACE}/adder.py"})["content"] == STUB
    names = {e["name"] for e in tools.call("list", {"path": WORKSPACE})["entries"]}
    assert names == {"adder.py"}

    done = tools.call(
        "finish",
        {
            "checks": [{"name": "imports", "command": IMPORTS}],
            "task": _task(),
        },
    )
    assert done["environment"] == "adder", done
    report = done["report"]
    assert report["passed"] and report["failed"] == []
    by_name = {c["name"]: c for c in report["checks"]}
    assert by_name["reference-passes"]["reward"] == 1.0
    assert by_name["unmodified-fails"]["reward"] == 0.0
    assert by_name["reproducible"]["rewards"] == [1.0, 1.0]
    assert by_name["size"]["passed"]
    stored = json.loads(open(done["report_path"]).read())
    assert stored["digest"] == report["digest"] and stored["passed"]

    # published: the layer under its name, nothing staged, a catalog entry, the session gone
    layers = _layers(ctx)
    assert "adder@1" in layers and not any(r.startswith(STAGED_PREFIX) for r in layers)
    record = ctx.store.get("adder")
    assert (record.state, record.published, record.staged) == ("published", "adder@1", "")
    published = LayerStore(ctx.config.layer_dir).resolve("adder@1")
    assert published.source.startswith("dsec build adder from python; QA passed: size, imports")
    assert sid not in {s.id for s in ctx.client.list()}
    # a task with a hidden test is not registered: its test stays with the builder
    catalogs = CatalogStore(python_node.config.catalog_dir)
    assert catalogs.environment("adder").toolkits[0] == "adder@1"
    assert "adder" not in {t.name for t in catalogs.tasks()}
    saved = ctx.store.task("adder")
    assert saved is not None and saved["tests"] == {f"{WORKSPACE}/test_hidden.py": HIDDEN_TEST}
    tools_log = [e["tool"] for e in ctx.store.read_log("adder")]
    assert tools_log[:2] == ["start", "exec"] and tools_log[-1] == "finish"

    # a fresh client creates the new environment: the workspace is there, hidden test and
    # builder's notes are not
    with Client(os.fspath(python_node.config.socket_path)) as fresh:
        with fresh.create(environment="adder", ttl=120) as sb:
            r = sb.exec(
                f"cat {WORKSPACE}/adder.py; ls {WORKSPACE}; ls -d {BUILD_NOTES_DIR} || echo clean"
            )
            assert r.exit_code == 0, r
            assert r.text == STUB + "adder.py\nclean\n"
        # a grader runs the published task with its hidden test (from the build's task.json)
        spec = TaskSpec.from_dict(ctx.store.task("adder"), "adder")
        result, reward = run_task(fresh, "adder", spec)
        assert reward == 0.0 and "NotImplementedError" in result.text
        assert run_task(fresh, "adder", spec, files=spec.reference)[1] == 1.0


def test_qa_failure_keeps_the_layer_staged_and_publishes_nothing(ctx, python_node):
    session = BuildSession.start(ctx, from_env="python", name="adder-bad", version="1")
    tools = BuildTools(session)
    _workspace(tools)
    wrong = {f"{WORKSPACE}/adder.py": "def add(a, b):\n    return a - b  # wrong on purpose\n"}
    with pytest.raises(QAFailed) as err:
        tools.call("finish", {"task": _task(reference=wrong), "max_bytes": "1M"})
    assert set(err.value.failed) == {"reference-passes", "reproducible"} or "reference-passes" in (
        err.value.failed
    )
    record = ctx.store.get("adder-bad")
    assert record.state == "qa-failed" and record.staged == f"{STAGED_PREFIX}adder-bad@1"
    report = ctx.store.report("adder-bad")
    assert report is not None and not report["passed"]
    layers = _layers(ctx)
    assert record.staged in layers and "adder-bad@1" not in layers
    with pytest.raises(UnknownEnvironment):
        CatalogStore(python_node.config.catalog_dir).environment("adder-bad")
    # the session survives: fix the reference, finish again (the old staged layer replaced),
    # now with the test in the workspace for all to see: the task is registered
    copy = f"cp {BUILD_NOTES_DIR}/test_hidden.py {WORKSPACE}/test_visible.py"
    assert tools.call("exec", {"command": copy})["exit_code"] == 0
    done = tools.call("finish", {"task": _task(tests={})})
    assert done["layer"]["name"] == "adder-bad" and record.staged not in _layers(ctx)
    catalogs = CatalogStore(python_node.config.catalog_dir)
    (task,) = [t for t in catalogs.tasks() if t.name == "adder"]
    assert (task.environment, task.expect) == ("adder-bad", 0.0)


def test_a_leaked_hidden_test_fails_with_its_path_and_label(ctx):
    session = BuildSession.start(ctx, from_env="python", name="adder-leak", version="1")
    tools = BuildTools(session)
    _workspace(tools)
    tools.call("exec", {"command": f"cp {BUILD_NOTES_DIR}/test_hidden.py {WORKSPACE}/t.py"})
    with pytest.raises(LeakFound) as err:
        tools.call("finish", {"task": _task()})
    text = str(err.value)
    assert "t.py" in text and f"hidden-test:{WORKSPACE}/test_hidden.py" in text
    assert "add(-7, 4)" not in text  # never the secret itself
    assert not any(r.startswith(f"{STAGED_PREFIX}adder-leak") for r in _layers(ctx))
    assert ctx.store.get("adder-leak").state == "leaked"
    # the session survives: remove the copy and finish again
    tools.call("exec", {"command": f"rm {WORKSPACE}/t.py"})
    assert tools.call("finish", {"task": _task()})["layer"]["name"] == "adder-leak"


def test_finish_on_a_killed_session_is_typed_and_leaves_nothing_staged(ctx):
    with pytest.raises(UnknownEnvironment):
        BuildSession.start(ctx, from_env="no-such-env", name="nowhere")
    assert "nowhere" not in {r.name for r in ctx.store.list()}  # no record of a failed start
    session = BuildSession.start(ctx, from_env="python", name="dead", version="1")
    tools = BuildTools(session)
    tools.call("write", {"path": "/root/x", "content": "x"})
    with pytest.raises(InvalidSpec, match="max_bytes"):
        tools.call("finish", {"max_bytes": "lots"})
    assert ctx.store.get("dead").state == "open" and ctx.store.get("dead").staged == ""
    ctx.client.kill(session.sandbox_id)
    with pytest.raises(BuildSessionLost):
        tools.call("finish", {})
    assert not any(r.startswith(f"{STAGED_PREFIX}dead") for r in _layers(ctx))
    assert ctx.store.get("dead").state == "lost"
    with pytest.raises(InvalidSpec, match="lost"):
        tools.call("exec", {"command": "true"})


def test_plan_replay_and_bad_steps_keep_the_session(ctx):
    session = BuildSession.start(ctx, from_env="python", name="planned", version="1")
    tools = BuildTools(session)
    plan = f"""
- {{tool: exec, args: {{command: "mkdir -p {WORKSPACE}"}}, expect_exit: 0}}
- {{tool: write, args: {{path: {WORKSPACE}/adder.py, content: "def add(a, b): return a + b\\n"}}}}
- tool: session_exec
  args: {{command: "cd {WORKSPACE} && python3 -c 'import adder; print(adder.add(1, 2))'"}}
- {{tool: read, args: {{path: {WORKSPACE}/adder.py}}}}
"""
    results = run_plan(plan, tools)
    assert [r.get("exit_code") for r in results[::2]] == [0, 0]
    assert results[2]["stdout"] == "3\n" and "return a + b" in results[3]["content"]
    with pytest.raises(BuildToolError) as err:
        run_plan("- {tool: exec, args: {command: 'true'}}\n- {tool: format_disk}\n", tools)
    assert err.value.step == 1 and "format_disk" in str(err.value)
    with pytest.raises(BuildToolError) as err:
        run_plan([{"tool": "write", "args": {"path": "/x", "content": 3}}], tools)
    assert err.value.step == 0 and "content" in str(err.value)
    # the session survives and goes on
    done = run_plan(
        [
            {"tool": "exec", "args": {"command": "cat /workspace/adder/adder.py"}},
            {"tool": "finish", "args": {"checks": [{"name": "imp", "command": "true"}]}},
        ],
        tools,
    )
    assert "return a + b" in done[0]["stdout"] and done[1]["layer"]["name"] == "planned"
    log = list(BuildStore(ctx.home).read_log("planned"))
    assert any("BuildToolError" in e.get("error", "") for e in log)


async def test_mcp_server_over_stdio(ctx, python_node):
    from mcp.client.session import ClientSession
    from mcp.client.stdio import StdioServerParameters, stdio_client

    BuildSession.start(ctx, from_env="python", name="mcp-built", version="1")
    env = {
        "DSEC_HOME": os.fspath(python_node.home),
        "PYTHONPATH": os.environ.get("PYTHONPATH", ""),
        "PATH": os.environ["PATH"],
    }
    params = StdioServerParameters(
        command=sys.executable,
        args=["-m", "dsec_core.cli", "build", "mcp", "--name", "mcp-built"],
        env=env,
    )
    async with stdio_client(params) as (read, write), ClientSession(read, write) as mcp:
        await mcp.initialize()
        listed = await mcp.list_tools()
        assert {t.name for t in listed.tools} == {
            "exec",
            "session_exec",
            "read",
            "write",
            "list",
            "finish",
        }

        async def call(name, args):
            return await mcp.call_tool(name, args)

        r = await call("write", {"path": "/root/hello.txt", "content": "hi from mcp\n"})
        assert not r.is_error, r
        r = await call("exec", {"command": "cat /root/hello.txt"})
        assert not r.is_error and r.structured_content["stdout"] == "hi from mcp\n"
        r = await call("read", {"path": "/root/hello.txt"})
        assert r.structured_content["content"] == "hi from mcp\n"
        r = await call("list", {"path": "/root"})
        assert "hello.txt" in {e["name"] for e in r.structured_content["entries"]}
        bad = await call("exec", {"command": 5, "nonsense": True})
        assert bad.is_error
        unknown = await call("format_disk", {})
        assert unknown.is_error
        r = await call("exec", {"command": "echo still here"})  # the session survives
        assert r.structured_content["stdout"] == "still here\n"
        r = await call("finish", {"checks": [{"name": "hello", "command": "test -f hello.txt"}]})
        assert not r.is_error, r
        assert r.structured_content["layer"]["name"] == "mcp-built"
    assert ctx.store.get("mcp-built").state == "published"


def _dsec(python_node, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = dict(os.environ, DSEC_HOME=os.fspath(python_node.home))
    for var in ("DSEC_ADDRESS", "DSEC_API_KEY", "DSEC_RUNTIME_ADDRESS", "DSEC_RUNTIME_API_KEY"):
        env.pop(var, None)
    out = subprocess.run(
        [sys.executable, "-m", "dsec_core.cli", "build", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if check:
        assert out.returncode == 0, out.stderr
    return out


def test_cli_start_exec_ls_finish_and_publish_to_a_source(ctx, python_node, tmp_path):
    started = json.loads(
        _dsec(
            python_node,
            "start",
            "--from",
            "python",
            "--name",
            "clibuilt",
            "--version",
            "2",
            "--json",
        ).stdout
    )
    assert started["state"] == "open" and started["sandbox_id"]
    again = _dsec(python_node, "start", "--from", "python", "--name", "clibuilt", check=False)
    assert again.returncode == 1 and again.stderr.startswith("Error: build clibuilt is open")
    out = _dsec(python_node, "exec", "clibuilt", "echo", "built >", "/root/made-by-cli")
    assert out.returncode == 0
    failed = _dsec(python_node, "exec", "clibuilt", "exit 3", check=False)
    assert failed.returncode == 3
    bad = _dsec(python_node, "call", "clibuilt", "format_disk", check=False)
    assert bad.returncode == 1 and "unknown tool 'format_disk'" in bad.stderr
    assert "Traceback" not in bad.stderr
    listed = json.loads(_dsec(python_node, "ls", "--json").stdout)
    assert {"name": "clibuilt", "state": "open"}.items() <= next(
        r for r in listed if r["name"] == "clibuilt"
    ).items()
    spec = tmp_path / "finish.yaml"
    spec.write_text("checks:\n  - {name: made, command: 'grep -q built /root/made-by-cli'}\n")
    shared = tmp_path / "shared"
    shared.mkdir()
    done = json.loads(
        _dsec(
            python_node,
            "finish",
            "clibuilt",
            "--spec",
            os.fspath(spec),
            "--publish",
            f"posix:{shared}",
            "--json",
        ).stdout
    )
    assert done["layer"]["name"] == "clibuilt" and done["layer"]["version"] == "2"
    # the catalog and its layers went to the source: another node could pull it
    from dsec_layer_posix import PosixLayerSource

    source = PosixLayerSource(os.fspath(shared))
    assert source.get_catalog("clibuilt")["environments"][0]["name"] == "clibuilt"
    assert source.resolve(LayerRef.parse("clibuilt@2")) is not None
    _dsec(python_node, "rm", "clibuilt")
    assert "clibuilt" not in {r.name for r in ctx.store.list()}
    # a scripted build from the command line: start, replay, and a bad step as one line
    plan = tmp_path / "plan.yaml"
    plan.write_text("- {tool: exec, args: {command: 'echo planned'}}\n- {tool: nope}\n")
    ran = _dsec(
        python_node, "run", os.fspath(plan), "--from", "python", "--name", "cliplan", check=False
    )
    assert ran.returncode == 1 and ran.stderr.startswith("Error: step 1 (nope): unknown tool")
    plan.write_text("- {tool: exec, args: {command: 'echo planned'}}\n")
    steps = json.loads(_dsec(python_node, "run", os.fspath(plan), "--name", "cliplan").stdout)
    assert steps[0]["stdout"] == "planned\n"
    _dsec(python_node, "rm", "cliplan")


def test_policy_indexes_are_all_the_session_reaches(ctx, python_node, tmp_path):
    from dsec_security_ebpf.testing import ServerNamespace

    with ServerNamespace(python_node.home, tmp_path, 7) as ns:
        ns.serve(tcp=[8081, 8082])
        apt = f"http://{ns.address}:8081/debian"
        policy = BuildPolicy.from_dict(
            {"indexes": [{"pip": f"http://{ns.address}:8081/simple"}, {"apt": apt}]}
        )
        with (
            Client(os.fspath(python_node.config.socket_path)) as c,
            c.create(environment="python", ttl=60) as plain,
        ):
            original = plain.read_file("/etc/apt/sources.list")
        session = BuildSession.start(
            ctx, from_env="python", name="egress", version="1", policy=policy
        )
        tools = BuildTools(session)
        granted = tools.call("read", {"path": "/etc/apt/sources.list"})["content"]
        assert apt in granted and granted.encode() != original
        send = (
            "python3 -c \"import os, socket, sys; s = socket.create_connection(('{a}', {p}), 3);"
            " s.sendall(b'from-build-' + os.environ.get('PIP_INDEX_URL', '-').encode())\""
        )
        ok = tools.call("exec", {"command": send.format(a=ns.address, p=8081)})
        assert ok["exit_code"] == 0, ok
        refused = tools.call("exec", {"command": send.format(a=ns.address, p=8082)})
        assert refused["exit_code"] != 0
        got = [r for r in ns.received() if r.kind == "tcp"]
        assert [(r.port, r.data) for r in got] == [
            (8081, f"from-build-http://{ns.address}:8081/simple")
        ]
        # the granted mirror is put back before packing: the published apt is the base's
        tools.call("finish", {"checks": [{"name": "true", "command": "true"}]})
        with (
            Client(os.fspath(python_node.config.socket_path)) as c,
            c.create(environment="egress", ttl=60) as built,
        ):
            assert built.read_file("/etc/apt/sources.list") == original


async def test_mcp_server_over_streamable_http_on_loopback(ctx, python_node):
    import anyio
    from mcp.client.session import ClientSession
    from mcp.client.streamable_http import streamable_http_client

    session = BuildSession.start(ctx, from_env="python", name="mcp-http", version="1")
    env = dict(os.environ, DSEC_HOME=os.fspath(python_node.home))
    proc = subprocess.Popen(
        [sys.executable, "-m", "dsec_core.cli", "build", "mcp", "--name", "mcp-http", "--http"],
        env=env,
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        url = line[line.index("http://") :].strip()
        assert url.startswith("http://127.0.0.1:") and url.endswith("/mcp"), line
        host, port = url[len("http://") :].split("/")[0].split(":")
        for _ in range(100):  # until uvicorn listens
            try:
                await (await anyio.connect_tcp(host, int(port))).aclose()
                break
            except OSError:
                await anyio.sleep(0.1)
        async with streamable_http_client(url) as (read, write), ClientSession(read, write) as mcp:
            await mcp.initialize()
            assert len((await mcp.list_tools()).tools) == 6
            r = await mcp.call_tool("session_exec", {"command": "echo over http"})
            assert not r.is_error and r.structured_content["stdout"] == "over http\n"
    finally:
        stop_process(proc, 10)
        if proc.stderr:
            proc.stderr.close()
    assert proc.returncode is not None
    session.kill()
