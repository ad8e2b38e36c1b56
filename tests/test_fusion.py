"""SandboxFusion's ``POST /run_code`` (issue 23, deliverable 3) on a real node daemon and a real
apiserver, through the stock ``sandbox_fusion`` client and verl's own code-reward module, run
in warm FnCall members of the default catalog's ``python`` and ``dev`` (g++) environments.

verl's package imports torch at its top, so it is installed without its dependencies (run.sh
setup, into .venv/verl) and its reward module, ``verl/utils/reward_score/sandbox_fusion/``
(``requests`` and the standard library only), is loaded by path as a package of its own:
``verl/__init__.py`` never runs and nothing needs stubbing.

The base layers are the default catalog's, which ``run.sh test`` builds into DSEC_TEST_HOME
before the suite (debootstrap); they are linked into the test node's own store.
"""

from __future__ import annotations

import base64
import importlib.util
import json
import os
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest
import requests

from dsec_core.api.serving import request_key
from dsec_core.catalog.model import Catalog, Environment
from dsec_core.catalog.store import CatalogStore
from dsec_core.errors import InvalidSpec
from dsec_core.fusion import environments, member_memory, parse_request
from dsec_core.iam import Iam
from dsec_core.layers.store import LayerStore
from dsec_core.testing import KitNode
from dsec_core.testing.apiserver import named_nodes, running_apiserver

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root")

sandbox_fusion = pytest.importorskip("sandbox_fusion")
RunCodeRequest = sandbox_fusion.RunCodeRequest

#: The default catalog's environments that /run_code uses by default, and their base layers.
BASES = {"python": "debian-python@12-2", "dev": "debian-dev@12"}

SUM = "a, b = map(int, input().split())\nprint(a + b)\n"
CPP_SUM = """#include <iostream>
int main() { long long a, b; std::cin >> a >> b; std::cout << a + b << std::endl; }
"""


@dataclass
class Plane:
    node: str  # http://dsec:TOKEN@127.0.0.1:PORT: the node, its token as Basic auth's password
    api: str  # the apiserver, a key of project "fusion" likewise
    api_bare: str  # the apiserver without a key
    kit: KitNode  # the node, for a look at its pools


def _link_layer(source: LayerStore, target: LayerStore, ref: str) -> None:
    info = source.resolve(ref)
    tmp = target.tmp_dir / f"{info.name}.erofs"
    target.tmp_dir.mkdir(parents=True, exist_ok=True)
    try:
        os.link(source.image_path(info), tmp)
    except OSError:  # another filesystem
        shutil.copyfile(source.image_path(info), tmp)
    target.add(tmp, name=info.name, version=info.version, kind=info.kind)


@pytest.fixture(scope="module")
def plane(built_catalog_config, tmp_path_factory) -> Iterator[Plane]:
    built = LayerStore(built_catalog_config.layer_dir)
    missing = [ref for ref in BASES.values() if not built.exists(ref)]
    if missing:
        pytest.skip(
            f"the default catalog's {missing} are not built in {built_catalog_config.home} "
            "(run.sh test builds them there first: dsec catalog build)"
        )
    iam_url = f"sqlite://{tmp_path_factory.mktemp('iam') / 'iam.db'}"
    iam = Iam.open(iam_url)
    iam.create_project("fusion")
    key = iam.create_key("fusion", "member")[1]
    env = {"DSEC_FNCALL_POOL_MAX": "4"}
    with named_nodes({"n1": {}}, env=env) as nodes:
        node = nodes[0]
        for ref in BASES.values():
            _link_layer(built, LayerStore(node.node.config.layer_dir), ref)
        CatalogStore(node.node.config.catalog_dir).save(
            Catalog(
                name="fusion",
                environments=tuple(
                    Environment(name=name, base=ref, env={"LANG": "C.UTF-8"})
                    for name, ref in BASES.items()
                ),
            )
        )
        with running_apiserver(nodes, iam_url) as api:
            host = api.url.removeprefix("http://")
            yield Plane(
                node=f"http://dsec:{node.token}@{node.url.removeprefix('http://')}",
                api=f"http://dsec:{key}@{host}",
                api_bare=api.url,
                kit=node.node,
            )
    iam.close()


def run(url: str, **kw) -> sandbox_fusion.RunCodeResponse:
    kw.setdefault("language", "python")
    return sandbox_fusion.run_code(RunCodeRequest(**kw), endpoint=url, max_attempts=1)


def post(url: str, body: object, **kw) -> requests.Response:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return requests.post(f"{url}/run_code", data=data, timeout=60, **kw)


#: Where run.sh setup installs verl (--no-deps, --target: off sys.path, since its wheel ships a
#: top-level ``tests`` package that would shadow ours).
VERL_DIR = Path(sys.prefix) / "verl"


@pytest.fixture(scope="module")
def verl_reward() -> ModuleType:
    """verl's ``verl.utils.reward_score.sandbox_fusion``, loaded from its file as a package
    named ``verl_sandbox_fusion`` (its ``from .utils import ...`` resolves inside it)."""
    where = VERL_DIR / "verl/utils/reward_score/sandbox_fusion"
    if not (where / "utils.py").is_file():
        pytest.skip(f"verl is not in {VERL_DIR} (run.sh setup installs it there, --no-deps)")
    spec = importlib.util.spec_from_file_location(
        "verl_sandbox_fusion", where / "__init__.py", submodule_search_locations=[str(where)]
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    assert "torch" not in sys.modules
    return module


@pytest.mark.parametrize("where", ["node", "api"])
def test_verl_scores_a_right_solution_1_and_a_wrong_one_0(plane, verl_reward, where):
    url = f"{getattr(plane, where)}/run_code"
    cases = {"inputs": ["1 2\n", "40 2\n", "-5 5\n"], "outputs": ["3\n", "42\n", "0\n"]}
    right = f"Here it is:\n```python\n{SUM}```\n"
    wrong = "```python\na, b = map(int, input().split())\nprint(a - b)\n```"
    sem = threading.Semaphore(8)
    score, meta = verl_reward.compute_score(url, sem, 256, right, cases)
    assert score == 1.0, meta
    assert {m["status"] for m in meta} == {"success"}
    score, meta = verl_reward.compute_score(url, sem, 256, wrong, cases)
    assert score == 0.0, meta
    assert "wrong_answer" in {m["status"] for m in meta}
    # C++ through verl's check: compiled with g++ in the dev environment
    results, meta = verl_reward.check_correctness(
        url, {"inputs": ["20 22"], "outputs": ["42"]}, CPP_SUM, language="cpp"
    )
    assert results == [True], meta
    assert meta[0]["compile_status"] == "Finished"
    # verl's own codes: -4 a compile error, -3 a timeout, -2 a runtime error
    results, meta = verl_reward.check_correctness(
        url, {"inputs": ["1 2"], "outputs": ["3"]}, "int main( {", language="cpp"
    )
    assert results == [-4] and meta[0]["status"] == "compile_error", meta
    results, meta = verl_reward.check_correctness(
        url,
        {"inputs": ["1", "2"], "outputs": ["1", "2"]},
        "import sys, time\nif input() == '2': time.sleep(30)\nraise SystemExit(3)",
        timeout=1,
    )
    assert results == [-2, -3], meta
    assert [m["status"] for m in meta] == ["runtime_error", "timeout"]


def test_a_run_over_its_time_limit_is_time_limit_exceeded_without_a_return_code(plane):
    t0 = time.monotonic()
    r = run(
        plane.api, code="import time\nprint('started', flush=True)\ntime.sleep(30)\n", run_timeout=1
    )
    assert time.monotonic() - t0 < 10
    assert r.status == "Failed" and r.compile_result is None
    assert r.run_result.status == "TimeLimitExceeded" and r.run_result.return_code is None
    assert r.run_result.stdout == "started\n"
    assert 1 <= r.run_result.execution_time < 5


def test_a_cpp_compile_error_comes_back_in_compile_result_and_leaves_run_result_null(plane):
    r = run(plane.node, language="cpp", code="int main() { return undefined_name; }\n")
    assert r.status == "Failed" and r.run_result is None
    c = r.compile_result
    assert c.status == "Finished" and c.return_code not in (0, None)
    assert "undefined_name" in c.stderr
    summary = sandbox_fusion.client.summary_run_code_result(
        r, sandbox_fusion.SummaryMapping(CompileFailed="CE")
    )
    assert summary == "CE"
    ok = run(plane.node, language="cpp", code=CPP_SUM, stdin="1 2")
    assert ok.status == "Success" and ok.compile_result.return_code == 0
    assert ok.run_result.stdout == "3\n"


def test_stdin_is_passed_byte_for_byte(plane):
    hexdump = "import sys\nprint(sys.stdin.buffer.read().hex())\n"
    for stdin, want in [
        ("no newline at the end", b"no newline at the end"),
        ("two\nlines\n\n", b"two\nlines\n\n"),
        ("caf\u00e9 \u2603", "caf\u00e9 \u2603".encode()),
        ("\udcff\udc80raw", b"\xff\x80raw"),  # not UTF-8: surrogateescape's lone surrogates
        ("", b""),
        (None, b""),  # null: end of input at once
    ]:
        r = run(plane.api, code=hexdump, stdin=stdin)
        assert r.status == "Success", r
        assert bytes.fromhex(r.run_result.stdout.strip()) == want, stdin
    bash = run(plane.node, language="bash", code="wc -c; echo err >&2; exit 3", stdin="12345")
    assert bash.status == "Failed" and bash.run_result.status == "Finished"
    assert bash.run_result.return_code == 3
    assert bash.run_result.stdout.strip() == "5" and bash.run_result.stderr == "err\n"


def test_output_is_kept_up_to_a_mebibyte(plane):
    r = run(plane.node, code="import sys\nsys.stdout.write('x' * (3 << 20))\n")
    assert r.status == "Success"
    assert r.run_result.stdout == "x" * (1 << 20)


def test_files_are_written_before_the_run_and_fetched_after_it(plane):
    code = (
        "import os\n"
        "data = open('data/in.bin', 'rb').read()\n"
        "open('out.bin', 'wb').write(data[::-1])\n"
        "os.makedirs('deep/er', exist_ok=True)\n"
        "open('deep/er/note.txt', 'w').write('hi')\n"
        "print(len(data))\n"
    )
    blob = bytes(range(256)) * 3
    for url in (plane.node, plane.api):
        r = run(
            url,
            code=code,
            files={"data/in.bin": base64.b64encode(blob).decode()},
            fetch_files=["out.bin", "deep/er/note.txt", "never-made.txt"],
        )
        assert r.status == "Success", r
        assert r.executor_pod_name  # the FnCall member that ran it
        assert r.run_result.stdout == "768\n"
        assert base64.b64decode(r.files["out.bin"]) == blob[::-1]
        assert base64.b64decode(r.files["deep/er/note.txt"]) == b"hi"
        assert "never-made.txt" not in r.files


def test_runs_through_the_apiserver_use_the_projects_pools(plane):
    raw = post(plane.api, {"code": "print('api')", "language": "python"})
    assert raw.status_code == 200 and raw.headers["content-type"] == "application/json"
    assert raw.json()["run_result"]["stdout"] == "api\n"
    assert run(plane.node, code="print('node')").run_result.stdout == "node\n"
    with plane.kit.client() as c:
        pools = {(p["name"].partition("@")[0], p["project"]) for p in c.node_info()["pools"]}
    # the key's project's pool, and the node's shared one of direct callers
    assert {("python/fncall/1cpu/1024M", "fusion"), ("python/fncall/1cpu/1024M", None)} <= pools


def test_each_run_starts_clean(plane):
    # members are reset between runs: a file one left behind is gone for the next
    run(plane.node, language="bash", code="echo left > leftover; echo left > /tmp/leftover")
    r = run(plane.node, language="bash", code="ls leftover /tmp/leftover 2>&1; true")
    assert "No such file" in r.run_result.stdout


def test_a_memory_limit_is_enforced_by_the_kernel(plane):
    hog = "x = b'x' * (400 << 20)\nprint('allocated')\n"
    small = post(plane.api, {"code": hog, "language": "python", "memory_limit_MB": 128})
    assert small.status_code == 200, small.text
    body = small.json()
    assert body["status"] == "Failed" and body["run_result"]["return_code"] != 0
    assert "allocated" not in body["run_result"]["stdout"]
    assert "over the memory limit" in body["run_result"]["stderr"]  # the cgroup's OOM kill
    big = post(plane.api, {"code": hog, "language": "python", "memory_limit_MB": 1024})
    assert big.json()["status"] == "Success", big.text


def test_bad_requests_are_clear_4xx_errors_in_sandbox_fusions_shape(plane):
    for url in (plane.node, plane.api):
        r = post(url, {"code": "print(1)", "language": "cobol"})
        assert r.status_code == 422 and r.headers["content-type"] == "application/json"
        body = r.json()
        assert body["status"] == "SandboxError" and "cobol" in body["message"]
        assert "python" in body["detail"] and body["error"]["type"] == "InvalidSpec"
        for bad in (b"{not json", b"[1, 2]", json.dumps({"language": "python"}).encode()):
            r = post(url, bad)
            assert r.status_code == 422 and r.json()["status"] == "SandboxError", r.text
        r = post(url, {"code": "1", "language": "python", "run_timeout": "soon"})
        assert r.status_code == 422 and "run_timeout" in r.json()["message"]
        r = post(url, {"code": "1", "language": "python", "files": {"a": "%%%"}})
        assert r.status_code == 422 and "base64" in r.json()["message"]
    with pytest.raises(Exception, match="422"):
        run(plane.api, language="go", code="package main")


def test_no_key_no_run(plane):
    anonymous = post(plane.api_bare, {"code": "print(1)", "language": "python"})
    assert anonymous.status_code == 401
    assert anonymous.json()["error"]["type"] == "AuthenticationFailed"
    wrong = post(plane.api_bare, {"code": "print(1)", "language": "python"}, auth=("dsec", "no"))
    assert wrong.status_code == 401
    # the key as Basic auth's password works for the node API's routes too, and so do the
    # existing forms
    key = requests.utils.urlparse(plane.api).password
    for kw in ({"auth": ("anyone", key)}, {"headers": {"Authorization": f"Bearer {key}"}}):
        r = requests.get(f"{plane.api_bare}/v1/sandboxes", timeout=10, **kw)
        assert r.status_code == 200, r.text
    node_bare = "http://" + plane.node.rpartition("@")[2]
    assert post(node_bare, {"code": "print(1)", "language": "python"}).status_code == 401


def test_32_concurrent_requests_are_all_answered_right(plane):
    def one(i: int) -> tuple[int, str]:
        url = plane.api if i % 2 else plane.node
        language = "bash" if i % 4 == 3 else "python"
        code = "read a; echo $((a * a))" if language == "bash" else "print(int(input()) ** 2)"
        r = run(url, language=language, code=code, stdin=f"{i}\n")
        return i, r.run_result.stdout if r.status == "Success" else repr(r)

    with ThreadPoolExecutor(32) as pool:
        answers = dict(pool.map(one, range(32)))
    assert answers == {i: f"{i * i}\n" for i in range(32)}


# --- the translation alone (dsec_core.fusion) ------------------------------------------------


def test_the_operator_picks_each_languages_environment(monkeypatch):
    body = json.dumps({"code": "int main(){}", "language": "cpp"}).encode()
    assert parse_request(body).environment == "dev"
    monkeypatch.setenv("DSEC_FUSION_ENVIRONMENTS", "cpp=gcc13, python=py312")
    assert environments() == {**environments(), "cpp": "gcc13", "python": "py312"}
    spec = parse_request(body)
    assert (spec.environment, spec.run) == ("gcc13", "./main") and "g++" in (spec.compile or "")
    assert spec.files == {"main.cpp": b"int main(){}"} and spec.memory_limit is None
    for bad in ("cpp", "cobol=x", "cpp="):
        monkeypatch.setenv("DSEC_FUSION_ENVIRONMENTS", bad)
        with pytest.raises(InvalidSpec, match="DSEC_FUSION_ENVIRONMENTS"):
            environments()
    # a memory limit sizes the member: the limit plus headroom, in steps, at least 1 GiB
    assert member_memory(None) == member_memory(256 << 20) == 1 << 30
    assert member_memory(1024 << 20) == 1280 << 20
    assert member_memory(1000 << 20) == 1280 << 20  # close limits share a pool


def test_a_key_rides_as_basic_auths_password_after_the_other_forms():
    def basic(pair: str) -> tuple[bytes, bytes]:
        return b"authorization", b"Basic " + base64.b64encode(pair.encode())

    assert request_key([basic("dsec:k1")]) == "k1"
    assert request_key([basic(":k1")]) == "k1"  # any user name, an empty one too
    assert request_key([basic("dsec:a:b")]) == "a:b"  # the password is all after the first ':'
    assert request_key([basic("dsec:k1"), (b"x-api-key", b"k2")]) == "k2"
    for bad in (basic("dsec"), basic("dsec:"), (b"authorization", b"Basic %%%")):
        assert request_key([bad]) is None
