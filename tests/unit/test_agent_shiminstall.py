"""Shim installation: version-named, read-only, atomic, never replacing a file in use."""

from __future__ import annotations

import mmap
import os
import stat
from pathlib import Path

import pytest
from kvgpu.agent import shiminstall
from kvgpu.agent.shiminstall import ShimInstallError, in_use, install_shim, prune_shims


def src(tmp_path: Path, data: bytes, name="build.so") -> Path:
    p = tmp_path / name
    p.write_bytes(data)
    return p


def test_install_layout(tmp_path):
    host = tmp_path / "lib"
    pre = tmp_path / "ld.so.preload"
    r = install_shim(src(tmp_path, b"v1"), "0.1.0", host, pre, is_in_use=lambda p: False)
    assert r.action == "installed" and r.switched
    f = host / "libvgpu.so.0.1.0"
    assert f.read_bytes() == b"v1" and stat.S_IMODE(f.stat().st_mode) == 0o444
    assert os.readlink(host / "libvgpu.so") == "libvgpu.so.0.1.0"  # relative link
    assert pre.read_text() == "/usr/local/kvgpu/lib/libvgpu.so\n"
    assert stat.S_IMODE(pre.stat().st_mode) == 0o444
    assert sorted(p.name for p in host.iterdir()) == ["libvgpu.so", "libvgpu.so.0.1.0"]  # no temp left
    # Idempotent.
    r2 = install_shim(src(tmp_path, b"v1"), "0.1.0", host, pre, is_in_use=lambda p: False)
    assert r2.action == "unchanged" and not r2.switched


def test_new_version_goes_beside_and_link_switches(tmp_path):
    host = tmp_path / "lib"
    install_shim(src(tmp_path, b"v1"), "0.1.0", host, None, is_in_use=lambda p: True)
    old_ino = (host / "libvgpu.so.0.1.0").stat().st_ino
    r = install_shim(src(tmp_path, b"v2"), "0.2.0", host, None, is_in_use=lambda p: True)
    assert r.action == "installed" and r.switched
    assert (host / "libvgpu.so.0.1.0").read_bytes() == b"v1"
    assert (host / "libvgpu.so.0.1.0").stat().st_ino == old_ino
    assert (host / "libvgpu.so").read_bytes() == b"v2"


def test_same_version_rebuilt_while_in_use_goes_beside(tmp_path):
    host = tmp_path / "lib"
    install_shim(src(tmp_path, b"v1"), "0.1.0", host, None, is_in_use=lambda p: False)
    f = host / "libvgpu.so.0.1.0"
    # A real mapping of the file by this process: the default in_use() must see it.
    with open(f, "rb") as fh, mmap.mmap(fh.fileno(), 0, prot=mmap.PROT_READ):
        assert in_use(f)
        r = install_shim(src(tmp_path, b"v1-rebuilt"), "0.1.0", host, None)
        assert r.action == "beside" and r.path.name.startswith("libvgpu.so.0.1.0-")
        assert f.read_bytes() == b"v1"  # untouched
        assert (host / "libvgpu.so").read_bytes() == b"v1-rebuilt"
    # Not in use any more: a further rebuild replaces the version file atomically.
    assert not in_use(f)
    r = install_shim(src(tmp_path, b"v1-third"), "0.1.0", host, None, is_in_use=lambda p: p == r.path)
    assert r.action == "replaced" and r.path == f and f.read_bytes() == b"v1-third"


def test_readers_never_see_partial_file(tmp_path, monkeypatch):
    host = tmp_path / "lib"
    install_shim(src(tmp_path, b"A" * 1000), "1", host, None, is_in_use=lambda p: False)
    seen = []
    real_replace = os.replace

    def spy(a, b):
        # At the moment of the rename the target still holds the complete old bytes.
        if Path(b).name == "libvgpu.so.1":
            seen.append(Path(b).read_bytes())
            assert Path(a).read_bytes() == b"B" * 2000
        return real_replace(a, b)

    monkeypatch.setattr(shiminstall.os, "replace", spy)
    install_shim(src(tmp_path, b"B" * 2000), "1", host, None, is_in_use=lambda p: False)
    assert seen == [b"A" * 1000]
    assert (host / "libvgpu.so.1").read_bytes() == b"B" * 2000


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


def test_prune_keeps_current_and_in_use(tmp_path):
    host = tmp_path / "lib"
    for i, v in enumerate(["1", "2", "3", "4"]):
        install_shim(src(tmp_path, v.encode()), v, host, None, is_in_use=lambda p: False)
        os.utime(host / f"libvgpu.so.{v}", (1000 + i, 1000 + i))
    removed = prune_shims(host, keep=1, is_in_use=lambda p: p.name == "libvgpu.so.1")
    assert sorted(p.name for p in removed) == ["libvgpu.so.2", "libvgpu.so.3"]
    assert sorted(p.name for p in host.iterdir()) == ["libvgpu.so", "libvgpu.so.1", "libvgpu.so.4"]


def test_errors(tmp_path):
    with pytest.raises(ShimInstallError):
        install_shim(tmp_path / "missing.so", "1", tmp_path / "lib", None)
    with pytest.raises(ShimInstallError):
        install_shim(src(tmp_path, b"x"), "../evil", tmp_path / "lib", None)
