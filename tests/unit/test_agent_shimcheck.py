"""The agent's shim check (``kvgpu.io/shim``): the real built shim installed and loaded by a real
child process, then removed, changed and broken; the annotation is written only on change."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from agent_helpers import FakeApi
from kvgpu.agent.discovery import SimulatedDiscovery
from kvgpu.agent.registration import Registrar
from kvgpu.agent.shimcheck import ShimCheck, dlopen_error
from kvgpu.agent.shiminstall import install_shim
from kvgpu.core import keys

BUILT = Path(__file__).resolve().parents[2] / "shim" / "_build" / "libvgpu.so"


def _install(tmp_path: Path, source: Path) -> ShimCheck:
    r = install_shim(source, "1.2.3", tmp_path / "lib", tmp_path / "ld.so.preload")
    return ShimCheck(str(tmp_path / "lib"), r.version, r.sha256)


@pytest.mark.skipif(not BUILT.exists(), reason="make shim builds shim/_build/libvgpu.so")
def test_installed_shim_loads_and_a_removed_one_is_named(tmp_path: Path) -> None:
    check = _install(tmp_path, BUILT)
    st = check.status()
    assert st["loadable"] is True and st["error"] == "" and st["file"] == "libvgpu.so.1.2.3", st
    (tmp_path / "lib" / "libvgpu.so.1.2.3").unlink()
    st = check.status()
    assert st["loadable"] is False and st["file"] == ""
    assert "libvgpu.so is missing (the link points at libvgpu.so.1.2.3, which is gone)" in str(st["error"])


def test_changed_file_is_named(tmp_path: Path) -> None:
    src = tmp_path / "src.so"
    src.write_bytes(b"one")
    check = _install(tmp_path, src)
    target = tmp_path / "lib" / "libvgpu.so.1.2.3"
    os.chmod(target, 0o644)
    target.write_bytes(b"two")
    st = check.status()
    assert st["loadable"] is False and "changed since the agent installed it" in str(st["error"]), st


def test_unloadable_file_gives_the_loaders_message(tmp_path: Path) -> None:
    src = tmp_path / "src.so"
    src.write_bytes(b"not an ELF file at all")
    st = _install(tmp_path, src).status()
    assert st["loadable"] is False
    assert "invalid ELF header" in str(st["error"]) or "too short" in str(st["error"]), st
    assert dlopen_error(tmp_path / "nope.so").endswith("No such file or directory")


def test_load_runs_again_only_when_the_file_changed(tmp_path: Path) -> None:
    src = tmp_path / "src.so"
    src.write_bytes(b"v1")
    calls: list[Path] = []
    check = _install(tmp_path, src)
    check.loader = lambda p: calls.append(p) or ""
    assert check.status()["loadable"] is True and check.status()["loadable"] is True
    assert len(calls) == 1
    src.write_bytes(b"v2")  # a new build: installed beside, the link switched
    r = install_shim(src, "1.2.4", tmp_path / "lib", None)
    check.version, check.sha256 = r.version, r.sha256
    assert check.status()["file"] == "libvgpu.so.1.2.4" and len(calls) == 2


async def test_registrar_writes_the_shim_annotation_only_on_change(tmp_path: Path) -> None:
    api = FakeApi()
    sim = tmp_path / "sim.json"
    sim.write_text(json.dumps({"nodes": [{"name": "gpu-0", "cards": [{"count": 1}]}]}))
    disc = SimulatedDiscovery("gpu-0", str(sim))
    status = {"loadable": True}
    reg = Registrar("gpu-0", api, disc, extra=lambda: {keys.NODE_SHIM: json.dumps(status)})
    await reg.refresh()
    await reg.refresh()
    assert [p for p, _ in api.patches if keys.NODE_SHIM in p] == [{keys.NODE_SHIM: '{"loadable": true}',
                                                                  keys.NODE_INVENTORY: reg.inventory.dumps()}]
    status["loadable"] = False
    await reg.refresh()
    assert api.patches[-1][0] == {keys.NODE_SHIM: '{"loadable": false}'}
    assert json.loads(api.node["metadata"]["annotations"][keys.NODE_SHIM]) == {"loadable": False}
