"""Shim installation: version-named, read-only, atomic; a name never gets other bytes; files
a container was served are never pruned."""

from __future__ import annotations

import mmap
import os
import shutil
import stat
from pathlib import Path

import pytest
from kvgpu.agent import shiminstall
from kvgpu.agent.shiminstall import (
    ShimInstallError,
    in_use,
    install_shim,
    prune_shims,
    record_shim_use,
    recorded_shims,
)


def src(tmp_path: Path, data: bytes, name="build.so") -> Path:
    p = tmp_path / name
    p.write_bytes(data)
    return p


def test_install_layout(tmp_path):
    host = tmp_path / "lib"
    pre = tmp_path / "ld.so.preload"
    r = install_shim(src(tmp_path, b"v1"), "0.1.0", host, pre)
    assert r.action == "installed" and r.switched
    f = host / "libvgpu.so.0.1.0"
    assert f.read_bytes() == b"v1" and stat.S_IMODE(f.stat().st_mode) == 0o444
    assert os.readlink(host / "libvgpu.so") == "libvgpu.so.0.1.0"  # relative link
    assert pre.read_text() == "/usr/local/kvgpu/lib/libvgpu.so\n"
    assert stat.S_IMODE(pre.stat().st_mode) == 0o444
    assert sorted(p.name for p in host.iterdir()) == ["libvgpu.so", "libvgpu.so.0.1.0"]  # no temp left
    # Idempotent.
    r2 = install_shim(src(tmp_path, b"v1"), "0.1.0", host, pre)
    assert r2.action == "unchanged" and not r2.switched


def test_new_version_goes_beside_and_link_switches(tmp_path):
    host = tmp_path / "lib"
    install_shim(src(tmp_path, b"v1"), "0.1.0", host, None)
    old_ino = (host / "libvgpu.so.0.1.0").stat().st_ino
    r = install_shim(src(tmp_path, b"v2"), "0.2.0", host, None)
    assert r.action == "installed" and r.switched
    assert (host / "libvgpu.so.0.1.0").read_bytes() == b"v1"
    assert (host / "libvgpu.so.0.1.0").stat().st_ino == old_ino
    assert (host / "libvgpu.so").read_bytes() == b"v2"


def test_same_version_rebuilt_goes_beside_and_a_mapping_keeps_its_bytes(tmp_path):
    host = tmp_path / "lib"
    install_shim(src(tmp_path, b"v1" * 4096), "0.1.0", host, None)
    f = host / "libvgpu.so.0.1.0"
    ino = f.stat().st_ino
    # A real mapping by this process; install_shim does not (cannot, in a DaemonSet) look for it.
    with open(f, "rb") as fh, mmap.mmap(fh.fileno(), 0, prot=mmap.PROT_READ) as mm:
        r = install_shim(src(tmp_path, b"v1-rebuilt"), "0.1.0", host, None)
        assert r.action == "beside" and r.path.name == f"libvgpu.so.0.1.0-{r.sha256[:12]}"
        assert mm[:] == b"v1" * 4096  # the mapped bytes are what they were
        assert f.read_bytes() == b"v1" * 4096 and f.stat().st_ino == ino
        assert (host / "libvgpu.so").read_bytes() == b"v1-rebuilt"
        # a third build of the same version: beside again, never over either file
        r3 = install_shim(src(tmp_path, b"v1-third"), "0.1.0", host, None)
        assert r3.action == "beside" and r3.path not in (f, r.path)
        assert f.read_bytes() == b"v1" * 4096 and r.path.read_bytes() == b"v1-rebuilt"
        assert mm[:] == b"v1" * 4096
    # back to the second build: its file is found, not rewritten
    again = install_shim(src(tmp_path, b"v1-rebuilt"), "0.1.0", host, None)
    assert again.action == "unchanged" and again.path == r.path and again.switched


def test_readers_never_see_partial_file(tmp_path, monkeypatch):
    host = tmp_path / "lib"
    install_shim(src(tmp_path, b"A" * 1000), "1", host, None)
    renames = []
    real_replace = os.replace

    def spy(a, b):
        # Only complete files are renamed into place, and never over an existing shim file.
        if Path(b).name.startswith("libvgpu.so."):
            assert not Path(b).exists()
            assert Path(a).read_bytes() == b"B" * 2000
            renames.append(Path(b).name)
        return real_replace(a, b)

    monkeypatch.setattr(shiminstall.os, "replace", spy)
    r = install_shim(src(tmp_path, b"B" * 2000), "1", host, None)
    assert renames == [r.path.name]
    assert (host / "libvgpu.so.1").read_bytes() == b"A" * 1000
    assert (host / "libvgpu.so").read_bytes() == b"B" * 2000


def test_in_use_via_mountinfo(tmp_path):
    proc = tmp_path / "proc"
    f = tmp_path / "libvgpu.so.9"
    f.write_bytes(b"x")
    st = f.stat()
    (proc / "42").mkdir(parents=True)
    (proc / "42" / "maps").write_text("")
    dev = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    (proc / "42" / "mountinfo").write_text(
        f"1 0 {dev} / / rw - ext4 /dev/x rw\n"
        f"2 1 {dev} /usr/local/kvgpu/lib/libvgpu.so.9 /usr/local/kvgpu/lib/libvgpu.so ro - ext4 /dev/x ro\n"
    )
    assert in_use(f, proc=str(proc))
    (proc / "42" / "mountinfo").write_text(f"1 0 {dev} / / rw - ext4 /dev/x rw\n")
    assert not in_use(f, proc=str(proc))


def test_prune_keeps_current_in_use_and_recorded(tmp_path):
    host = tmp_path / "lib"
    regions = tmp_path / "regions"
    for i, v in enumerate(["1", "2", "3", "4", "5"]):
        install_shim(src(tmp_path, v.encode()), v, host, None)
        os.utime(host / f"libvgpu.so.{v}", (1000 + i, 1000 + i))
    # the device plugin served 2 to a container of pod "uid-a" (its region dir is beside)
    rec = record_shim_use(regions, "uid-a", "main", "libvgpu.so.2")
    assert rec == regions / "uid-a" / "main.shim" and rec.read_text() == "libvgpu.so.2\n"
    assert stat.S_IMODE(rec.stat().st_mode) == 0o444
    assert recorded_shims(regions) == {"libvgpu.so.2"}
    removed = prune_shims(host, keep=1, is_in_use=lambda p: p.name == "libvgpu.so.1", region_root=regions)
    assert sorted(p.name for p in removed) == ["libvgpu.so.3", "libvgpu.so.4"]
    assert sorted(p.name for p in host.iterdir()) == ["libvgpu.so", "libvgpu.so.1", "libvgpu.so.2", "libvgpu.so.5"]
    # the pod is gone (its region directory collected): 2 may go now
    shutil.rmtree(regions / "uid-a")
    removed = prune_shims(host, keep=1, is_in_use=lambda p: False, region_root=regions)
    assert sorted(p.name for p in removed) == ["libvgpu.so.1", "libvgpu.so.2"]


def test_record_refuses_path_tricks(tmp_path):
    for bad in (("..", "c", "f"), ("u", "a/b", "f"), ("u", "c", "../f"), ("", "c", "f")):
        with pytest.raises(ValueError, match="not a path component"):
            record_shim_use(tmp_path, *bad)
    assert recorded_shims(None) == set()


def test_errors(tmp_path):
    with pytest.raises(ShimInstallError):
        install_shim(tmp_path / "missing.so", "1", tmp_path / "lib", None)
    with pytest.raises(ShimInstallError):
        install_shim(src(tmp_path, b"x"), "../evil", tmp_path / "lib", None)
