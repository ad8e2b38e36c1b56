#!/usr/bin/env bash
# One entry point for a fresh Debian 12 machine: installs what dsec needs (idempotently, and
# fast when already done), then runs the main job or the tests.
#
#   sudo bash run.sh demo     # dsec demo on the embedded single-node default
#   sudo bash run.sh test     # the checks below, then the test suite
#   sudo bash run.sh check    # only the checks: ruff (lint, format), mypy, the import floors, the docs
#   sudo bash run.sh setup    # only the set-up
#   sudo bash run.sh bench    # bench/create.py, queue.py, seccomp.py, disk.py, fncall.py, judge.py, vm.py, cluster.py, fleet.py, build.py and layers.py, each --quick, recorded in bench/results/ledger.jsonl
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$here"
venv="$here/.venv"
stamp_dir="$venv/.dsec-stamps"

# What a fresh machine needs: the Debian packages of dsec_core/linux/programs.txt, the one table
# of every external program dsec, its plugins, benches and tests run (program -> package).
apt_packages() {
    awk '!/^[[:space:]]*(#|$)/ && $2 != "-" { print $2 }' dsec_core/linux/programs.txt | sort -u
}
mapfile -t APT_PACKAGES < <(apt_packages)
[ ${#APT_PACKAGES[@]} -gt 0 ] || { echo "run.sh: no packages in dsec_core/linux/programs.txt" >&2; exit 1; }
# apparmor starts no service on install: its postinst enables apparmor.service for the next
# boot (a unit conditioned on the kernel having AppArmor, so inert here) and, only if the
# kernel has AppArmor enabled, loads the profiles in /etc/apparmor.d; a stock Debian 12 has
# the package already (the kernel image recommends it), so nothing changes there.

log() { printf '\033[1m[dsec setup]\033[0m %s\n' "$*" >&2; }

need_root() {
    if [ "$(id -u)" -ne 0 ]; then
        echo "run.sh: dsec needs root (mounts, cgroups, runc); run it with sudo" >&2
        exit 1
    fi
}

setup_apt() {
    local missing=()
    for p in "${APT_PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
    done
    if [ ${#missing[@]} -gt 0 ]; then
        log "installing Debian packages: ${missing[*]}"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -q >/dev/null
        # Packages like docker.io and docker-registry start services on install; dsec starts
        # what it needs itself, bound to loopback, so keep the package scripts from doing so.
        if [ ! -e /usr/sbin/policy-rc.d ]; then
            printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d
            chmod +x /usr/sbin/policy-rc.d
            trap 'rm -f /usr/sbin/policy-rc.d' EXIT
            apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
            rm -f /usr/sbin/policy-rc.d
            trap - EXIT
        else
            apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
        fi
        # lxcfs's package enables a service mounting /var/lib/lxcfs at boot; each dsec node
        # runs its own lxcfs, so one we just installed stays off (one already there is left be).
        if [[ " ${missing[*]} " == *" lxcfs "* ]] && command -v systemctl >/dev/null; then
            systemctl disable --quiet lxcfs 2>/dev/null || true
        fi
        # etcd-server's package enables etcd.service (a member listening on localhost:2379) for
        # the next boot (and starts it where no policy-rc.d holds it back); the tests start their
        # own etcd and an operator points DSEC_IAM at theirs, so one we just installed is stopped
        # and stays off.
        if [[ " ${missing[*]} " == *" etcd-server "* ]] && command -v systemctl >/dev/null; then
            systemctl disable --now --quiet etcd 2>/dev/null || true
        fi
    fi
}

setup_python() {
    local py="${PYTHON:-python3}"
    if [ ! -x "$venv/bin/python" ]; then
        log "creating the Python environment in .venv"
        "$py" -m venv "$venv"
    fi
    mkdir -p "$stamp_dir"
    # Reinstall only when a project file changed.
    local sum
    sum=$(cat pyproject.toml plugins/*/pyproject.toml builders/*/pyproject.toml | sha256sum | cut -c1-16)
    if [ ! -f "$stamp_dir/pip-$sum" ]; then
        log "installing dsec and its plugins into .venv"
        "$venv/bin/pip" install -q --upgrade pip >/dev/null 2>&1 || true
        local plugins=()
        # builders/ holds plugins too (the environment builder), installed the same way
        for d in plugins/*/ builders/*/; do
            d="${d%/}"
            # a plugin's own test needs (a local S3 server, ...) come with its [test] extra
            if grep -q '^test *=' "$d/pyproject.toml"; then plugins+=(-e "$d[test]")
            else plugins+=(-e "$d"); fi
        done
        # the node side (the `node` extra) too: a plain `pip install dsec` is the client alone
        if ! "$venv/bin/pip" install -q -e ".[node,test,rl,docs,bench]" "${plugins[@]}" >"$stamp_dir/pip.log" 2>&1; then
            cat "$stamp_dir/pip.log" >&2
            echo "run.sh: pip install failed" >&2
            exit 1
        fi
        # A plugin whose folder is gone (moved into core, say) must not stay installed.
        local dist
        for dist in $("$venv/bin/pip" list --format=freeze 2>/dev/null | sed -n 's/^\(dsec-[a-z0-9-]*\)==.*/\1/p'); do
            local dir="plugins/${dist#dsec-}" bdir="builders/${dist#dsec-}"
            [ -d "${dir//-/_}" ] || [ -d "${bdir//-/_}" ] || "$venv/bin/pip" uninstall -y -q "$dist" >/dev/null 2>&1 || true
        done
        local modules="dsec"
        for d in plugins/*/; do d="${d%/}"; modules+=",dsec_${d#plugins/}"; done
        for d in builders/*/; do d="${d%/}"; modules+=",dsec_${d#builders/}"; done
        "$venv/bin/python" -c "import $modules" \
            || { echo "run.sh: the Python install failed" >&2; exit 1; }
        rm -f "$stamp_dir"/pip-*
        touch "$stamp_dir/pip-$sum"
    fi
}

# tests/test_slim_client.py installs the client alone (`pip install dsec[rl]`, and `dsec[mcp]`)
# into fresh venvs without reaching an index: the client's dependencies wait here as wheels, pinned
# to the versions .venv has. Filled again when the client's requirements change.
setup_wheelhouse() {
    local house="$venv/wheelhouse" sum
    "$venv/bin/python" -c 'import tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]
x = p["optional-dependencies"]
print("\n".join(p["dependencies"] + x["rl"] + x["mcp"]))' >"$stamp_dir/client.txt"
    sum=$(sha256sum "$stamp_dir/client.txt" | cut -c1-16)
    [ -f "$stamp_dir/wheelhouse-$sum" ] && [ -d "$house" ] && return
    log "keeping the client's dependencies as wheels in .venv/wheelhouse"
    "$venv/bin/pip" freeze --exclude-editable | grep '==' >"$stamp_dir/pins.txt" || true
    if ! "$venv/bin/pip" download -q --only-binary=:all: -d "$house" -r "$stamp_dir/client.txt" \
            -c "$stamp_dir/pins.txt" >"$stamp_dir/wheelhouse.log" 2>&1; then
        cat "$stamp_dir/wheelhouse.log" >&2
        echo "run.sh: pip download of the client's wheels failed" >&2
        exit 1
    fi
    rm -f "$stamp_dir"/wheelhouse-*
    touch "$stamp_dir/wheelhouse-$sum"
}

# Harbor (PyPI `harbor`, the Terminal-Bench harness) needs Python >= 3.12, which dsec's .venv
# is not: it gets its own venv, .venv-harbor, with a pinned harbor (and its e2b extra, for
# Harbor's built-in `-e e2b`), dsec's slim client and the native provider plugins/harbor
# (`-e dsec_harbor:DsecEnvironment`); plugins/harbor/tests run Harbor's CLI from there. The
# first Python >= 3.12 found: python3.13/python3.12 on PATH, then pyenv's versions. None: it
# is skipped, saying so (and those tests skip, saying so).
HARBOR_VERSION=0.26.0
harbor_python() {
    local py
    for py in python3.13 python3.12 "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.1[2-9]*/bin/python3; do
        if command -v "$py" >/dev/null 2>&1 \
                && "$py" -c 'import sys, venv; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
            command -v "$py"
            return 0
        fi
    done
    return 1
}

setup_harbor() {
    local hvenv="$here/.venv-harbor" py sum
    if ! py="$(harbor_python)"; then
        log "no Python >= 3.12 on this machine: Harbor's venv is skipped (plugins/harbor's tests skip)"
        return 0
    fi
    if [ ! -x "$hvenv/bin/python" ]; then
        log "creating Harbor's Python environment in .venv-harbor ($py)"
        "$py" -m venv "$hvenv"
    fi
    mkdir -p "$hvenv/.dsec-stamps"
    sum=$( (echo "$HARBOR_VERSION"; cat pyproject.toml plugins/harbor/pyproject.toml) | sha256sum | cut -c1-16)
    [ -f "$hvenv/.dsec-stamps/pip-$sum" ] && return 0
    log "installing harbor $HARBOR_VERSION, dsec's client and dsec_harbor into .venv-harbor"
    "$hvenv/bin/pip" install -q --upgrade pip >/dev/null 2>&1 || true
    if ! "$hvenv/bin/pip" install -q "harbor[e2b]==$HARBOR_VERSION" -e . -e plugins/harbor \
            >"$hvenv/.dsec-stamps/pip.log" 2>&1; then
        cat "$hvenv/.dsec-stamps/pip.log" >&2
        echo "run.sh: pip install into .venv-harbor failed" >&2
        exit 1
    fi
    "$hvenv/bin/python" -c "import harbor, dsec, dsec_harbor; dsec_harbor.DsecEnvironment" \
        || { echo "run.sh: Harbor's venv does not import dsec_harbor" >&2; exit 1; }
    rm -f "$hvenv/.dsec-stamps"/pip-*
    touch "$hvenv/.dsec-stamps/pip-$sum"
}

# verl's code reward (verl/utils/reward_score/sandbox_fusion: requests and the standard library)
# is what tests/test_fusion.py runs against /run_code, loaded by path. verl's own dependencies
# (torch, ray, vllm: gigabytes) are not needed for it, so verl goes in without them, and into a
# directory of its own (.venv/verl) rather than site-packages: its wheel also ships a top-level
# `tests` package, which would shadow this repository's `tests` (from tests.conftest import ...).
VERL_VERSION=0.9.1
setup_verl() {
    [ -f "$stamp_dir/verl-dir-$VERL_VERSION" ] && return
    log "installing verl $VERL_VERSION without its dependencies into .venv/verl (its reward module only)"
    "$venv/bin/pip" uninstall -y -q verl >/dev/null 2>&1 || true  # an earlier setup's, if any
    rm -rf "$venv/verl"
    if ! "$venv/bin/pip" install -q --no-deps --target "$venv/verl" "verl==$VERL_VERSION" \
            >"$stamp_dir/verl.log" 2>&1; then
        cat "$stamp_dir/verl.log" >&2
        echo "run.sh: pip install --no-deps verl failed" >&2
        exit 1
    fi
    rm -f "$stamp_dir"/verl-*
    touch "$stamp_dir/verl-dir-$VERL_VERSION"
}

setup() {
    need_root
    setup_apt
    setup_python
    setup_verl
    setup_wheelhouse
    setup_harbor
}

checks() {
    log "checks: ruff, ruff format, mypy, import floors, the docs site"
    "$venv/bin/ruff" check --quiet .
    "$venv/bin/ruff" format --check --quiet .
    "$venv/bin/mypy" --no-error-summary
    "$venv/bin/lint-imports" --no-cache >/dev/null || "$venv/bin/lint-imports" --no-cache
    # every page, link, anchor and docstring of the API reference; built into a temporary
    # directory, so a check leaves no site/ behind
    local site
    site="$(mktemp -d)"
    NO_MKDOCS_2_WARNING=1 "$venv/bin/mkdocs" build --strict --quiet --site-dir "$site" \
        || { rm -rf "$site"; echo "run.sh: mkdocs build --strict failed" >&2; return 1; }
    rm -rf "$site"
}

cmd="${1:-demo}"
shift || true
case "$cmd" in
    setup)
        setup
        ;;
    demo)
        setup
        exec "$venv/bin/dsec" demo "$@"
        ;;
    check)
        setup
        checks
        ;;
    test)
        setup
        checks
        # The suite starts hundreds of Python processes (daemons, the CLI, apiservers) and each
        # pytest worker rewrites the test modules' asserts: with bytecode caching off (an
        # environment's PYTHONDONTWRITEBYTECODE), every one of them compiles dsec from source
        # again, 0.3 s of a daemon's start and 8 s of each worker's collection.
        unset PYTHONDONTWRITEBYTECODE
        # The suite's end-to-end demo test keeps its built catalog here between runs.
        export DSEC_TEST_HOME="${DSEC_TEST_HOME:-/var/lib/dsec-test}"
        DSEC_HOME="$DSEC_TEST_HOME" "$venv/bin/dsec" catalog build
        set +e
        # Several workers, each module on one (conftest.py gives each worker its own uid
        # ranges); DSEC_TEST_WORKERS=0 runs the suite in this process.
        workers="${DSEC_TEST_WORKERS:-4}"
        xdist=()
        [ "$workers" != 0 ] && xdist=(-n "$workers" --dist loadfile)
        "$venv/bin/pytest" -q -p no:cacheprovider "${xdist[@]}" --durations=25 "$@"
        rc=$?
        set -e
        [ "$rc" -eq 5 ] && { echo "run.sh: no tests ran" >&2; exit 1; }
        exit "$rc"
        ;;
    bench)
        setup
        # Each bench's last line (its figures) goes into bench/results/ledger.jsonl with the
        # commit and the machine (bench/ledger.py); bench/compare.py sets them against the run
        # before, and the README's figures come from the ledger. A bench that fails is recorded
        # as failed and the others still run; the exit code says whether any failed. The
        # arguments go to create.py, as they always did.
        failed=()
        record() { "$venv/bin/python" bench/ledger.py run "$@" || failed+=("$1"); }
        record bench/create.py --quick "$@"
        record bench/queue.py --quick
        record bench/seccomp.py --quick
        record bench/disk.py --quick
        record bench/fncall.py --quick
        record bench/judge.py --quick
        record bench/vm.py --quick
        record bench/cluster.py --quick
        record bench/fleet.py --quick
        record bench/build.py --quick
        record bench/layers.py --quick
        record bench/soak.py --quick
        # this run against the one before, and the README's figures rewritten from the ledger
        "$venv/bin/python" bench/compare.py || true
        "$venv/bin/python" bench/compare.py --readme
        if [ ${#failed[@]} -gt 0 ]; then
            echo "run.sh: ${#failed[@]} bench(es) failed, recorded as such: ${failed[*]}" >&2
            exit 1
        fi
        ;;
    *)
        echo "usage: run.sh [setup|demo|test|check|bench] [args...]" >&2
        exit 2
        ;;
esac
