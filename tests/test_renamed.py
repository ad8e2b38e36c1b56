"""This release's renames (``dsec_core.renamed``): every old name still imports, warns that it
is renamed, and is the very object of its new name; the docs' table lists each
(docs/plugins/renamed.md)."""

from __future__ import annotations

import importlib
import logging
import re
import sys
from pathlib import Path

import pytest

from dsec_core.node.pools import PoolSettings
from dsec_core.renamed import MODULES, NAMES
from dsec_core.vm import qemu

REPO = Path(__file__).resolve().parent.parent


def _warning(old: str, new: str) -> str:
    return re.escape(f"{old} is renamed {new}; the old name goes in the next release")


@pytest.mark.parametrize(("old", "new"), sorted(MODULES.items()))
def test_an_old_module_warns_on_import_and_gives_the_new_modules_objects(old, new):
    new_module = importlib.import_module(new)
    sys.modules.pop(old, None)  # imported before (by another test): import it afresh
    with pytest.warns(DeprecationWarning, match=_warning(old, new)) as caught:
        exec(compile(f"import {old}", __file__, "exec"), {})
    assert caught[0].filename == __file__  # the warning points at the import statement
    old_module = sys.modules[old]
    # the stub offers all of the new module's public names, each under its old name
    renamed = {f"{new}.{n}" for n in new_module.__all__}
    assert {NAMES.get(f"{old}.{n}", f"{new}.{n}") for n in old_module.__all__} == renamed
    for name in old_module.__all__:
        new_name = NAMES.get(f"{old}.{name}", f"{new}.{name}").rpartition(".")[2]
        assert getattr(old_module, name) is getattr(new_module, new_name)


@pytest.mark.parametrize(
    ("old", "new"),
    sorted((o, n) for o, n in NAMES.items() if o.rpartition(".")[0] not in MODULES),
)
def test_an_old_name_warns_and_is_the_new_object(old, new):
    module_name, _, name = old.rpartition(".")
    new_module, _, new_name = new.rpartition(".")
    expected = getattr(importlib.import_module(new_module), new_name)
    with pytest.warns(DeprecationWarning, match=_warning(old, new)):
        got = getattr(importlib.import_module(module_name), name)
    assert got is expected
    namespace: dict[str, object] = {}
    with pytest.warns(DeprecationWarning, match=_warning(old, new)):
        exec(f"from {module_name} import {name}", namespace)
    assert namespace[name] is expected


def test_a_module_with_renamed_names_still_has_no_others():
    with pytest.raises(AttributeError, match="has no attribute 'Floppy'"):
        qemu.Floppy  # noqa: B018


def test_vm_config_drives_warns_and_is_its_disks(tmp_path):
    disk = qemu.Disk(tmp_path / "rw.img", "dsec-rw", readonly=False)
    cfg = qemu.VmConfig(
        kernel=tmp_path / "vmlinux",
        initrd=tmp_path / "initrd",
        cmdline="",
        vcpus=1,
        memory_mib=128,
        qmp=tmp_path / "qmp.sock",
        console=tmp_path / "console.log",
        agent_fd=3,
        disks=(disk,),
    )
    with pytest.warns(DeprecationWarning, match=_warning("VmConfig.drives", "VmConfig.disks")):
        assert cfg.drives == (disk,)


def test_the_old_checkout_timeout_variable_is_read_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="dsec.pools"):
        assert PoolSettings.from_env({"DSEC_FNCALL_LEASE_TIMEOUT": "5"}).checkout_timeout == 5
    assert "DSEC_FNCALL_LEASE_TIMEOUT is renamed DSEC_FNCALL_CHECKOUT_TIMEOUT" in caplog.text
    both = {"DSEC_FNCALL_LEASE_TIMEOUT": "5", "DSEC_FNCALL_CHECKOUT_TIMEOUT": "7"}
    assert PoolSettings.from_env(both).checkout_timeout == 7


def test_the_docs_list_every_rename():
    section = (REPO / "docs" / "plugins" / "renamed.md").read_text()
    assert section.startswith("# Renamed in this release\n")
    rows = dict(re.findall(r"^\| `([^`]+)`[^|]*\| `([^`]+)`", section, re.M))
    assert {**MODULES, **NAMES}.items() <= rows.items()
