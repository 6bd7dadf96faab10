"""The plain-Python region reader (kvgpu.shimregion) against the shim's C layout and code.

The layout: a program compiled from ``shim/vgpu.h`` prints ``offsetof``/``sizeof`` of every field
that :mod:`kvgpu.shimregion` declares, and each struct's size; they must agree, so the
ctypes structures cannot drift from the header (the one source of truth; docs/shim.md's table is
checked against the same numbers). The behaviour: regions written by the shim's own C code (the
cffi build of ``vgpu_region.c``) read back through the plain reader, and the agent's two writes
seen by the C side.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from kvgpu import shimcore, shimregion

ROOT = Path(__file__).resolve().parents[2]
MIB = 1 << 20
STRUCTS = {"vgpu_region": shimregion.Region, "vgpu_region_dev": shimregion.RegionDev, "vgpu_slot": shimregion.Slot}


def _c_layout(tmp_path: Path) -> dict[str, int]:
    """``"struct.field" -> offset``, ``"struct.field#size" -> size`` and ``"struct" -> sizeof``
    from the header, for the fields the ctypes structures name."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler (make install needs gcc for the shim)")
    lines = []
    for cname, cls in STRUCTS.items():
        lines.append(f'printf("{cname} %zu\\n", sizeof(struct {cname}));')
        for fname, *_ in cls._fields_:
            lines.append(f'printf("{cname}.{fname} %zu\\n", offsetof(struct {cname}, {fname}));')
            lines.append(f'printf("{cname}.{fname}#size %zu\\n", sizeof(((struct {cname} *)0)->{fname}));')
    src = tmp_path / "layout.c"
    src.write_text('#include <stdio.h>\n#include "vgpu.h"\nint main(void) {\n' + "\n".join(lines) + "\nreturn 0; }\n")
    exe = tmp_path / "layout"
    subprocess.run([cc, "-std=gnu11", "-I", str(ROOT / "shim"), "-o", str(exe), str(src), "-pthread"], check=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    return {k: int(v) for k, v in (line.split() for line in out.splitlines())}


def test_ctypes_layout_is_the_headers(tmp_path: Path) -> None:
    c = _c_layout(tmp_path)
    py: dict[str, int] = {}
    for cname, cls in STRUCTS.items():
        py[cname] = ctypes.sizeof(cls)
        for fname, *_ in cls._fields_:
            py[f"{cname}.{fname}"] = getattr(cls, fname).offset
            py[f"{cname}.{fname}#size"] = getattr(cls, fname).size
    assert py == c


def test_header_constants_are_the_readers() -> None:
    h = (ROOT / "shim" / "vgpu.h").read_text()

    def define(name: str) -> int:
        m = re.search(rf"#define {name} (0x[0-9a-fA-F]+|\d+)u?\b", h)
        assert m, name
        return int(m.group(1), 0)

    assert define("VGPU_REGION_MAGIC") == shimregion.MAGIC
    assert define("VGPU_REGION_VERSION") == shimregion.VERSION
    assert define("VGPU_MAX_DEV") == shimregion.MAX_DEV
    assert define("VGPU_MAX_SLOTS") == shimregion.MAX_SLOTS
    assert define("VGPU_UUID_LEN") == shimregion.UUID_LEN
    assert define("VGPU_CLAIM_LEN") == shimregion.CLAIM_LEN


def test_docs_table_is_the_layout() -> None:
    doc = (ROOT / "docs" / "shim.md").read_text()
    section = doc.split("## Shared region", 1)[1].split("\n## ", 1)[0]
    assert f"{shimregion.REGION_SIZE} bytes, version {shimregion.VERSION}" in section
    rows = dict(re.findall(r"^\| (\d+) \| [^|]+ \| `(\w+)", section, flags=re.M))
    R = shimregion.Region
    for off, name in rows.items():
        assert getattr(R, name).offset == int(off), (name, off)
    assert f"slot[{shimregion.MAX_SLOTS}]" in section and f"| {R.slot.offset} |" in section
    assert f"({ctypes.sizeof(shimregion.RegionDev)} bytes)" in section
    assert f"({ctypes.sizeof(shimregion.Slot)} bytes)" in section


def _open_region(path: Path, claim_text: str) -> tuple[object, object]:
    m = shimcore.core()
    cfg = m.ffi.new("struct vgpu_config *")
    assert m.lib.vgpu_claim_parse(claim_text.encode(), cfg) == 0
    h = m.ffi.new("struct vgpu_region_handle *")
    assert m.lib.vgpu_region_open(h, str(path).encode(), cfg) == 0
    return m, h


UUID0 = "GPU-5a110000-0000-0000-0000-000000000000"
UUID1 = "GPU-5a110000-0000-0000-0000-000000000001"


def test_plain_reader_reads_what_the_shim_wrote(tmp_path: Path) -> None:
    path = tmp_path / "vgpu.region"
    m, h = _open_region(path, f"v1;claim=team-a/job;priority=0;dev={UUID0},3000,30;dev={UUID1},1000,0")
    lib = m.lib
    pid = os.getpid()  # a live process: the shim reaps slots of dead ones
    start = lib.vgpu_proc_start_time(pid)
    try:
        assert lib.vgpu_region_join(h, pid, start) >= 0
        assert lib.vgpu_region_reserve(h, 0, 700 * MIB) == 0
        assert lib.vgpu_region_set_overhead(h, 0, 300 * MIB) == 300 * MIB
        assert lib.vgpu_region_reserve(h, 1, 5000 * MIB) != 0  # over the 1000 MiB limit: refused
        lib.vgpu_region_oom_record(h.r, 1, pid, 12 * MIB)
        r = shimregion.read_region(path)
        assert (r.claim, r.priority, r.generation) == ("team-a/job", 0, 1)
        assert [(d.uuid, d.limit_mib, d.cores, d.used_mib) for d in r.devices] == [
            (UUID0, 3000, 30, 1000), (UUID1, 1000, 0, 0)]
        assert [(p.pid, p.host_pid, p.data_mib, p.overhead_mib) for p in r.devices[0].processes] == [
            (pid, 0, 700, 300)]
        assert (r.oom_kills, r.oom_last_pid, r.oom_last_dev, r.oom_last_mib) == (1, pid, 1, 12)

        # the agent's writes, seen by the C side
        assert shimregion.set_host_pid(path, pid, 99001, start)
        assert not shimregion.set_host_pid(path, pid, 99001, start)  # unchanged
        assert not shimregion.set_host_pid(path, pid, 5, start + 1)  # another start time: PID reuse
        assert not shimregion.set_host_pid(path, 1, 5, None)  # no such process
        slot = next(s for s in h.r.slot if s.pid == pid)
        assert slot.host_pid == 99001
        assert h.r.dev[0].unused == h.r.dev[1].unused == 0xFFFFFFFF

        lib.vgpu_region_leave(h)
        after = shimregion.read_region(path)
        assert after.devices[0].used_mib == 0 and after.devices[0].processes == ()
    finally:
        lib.vgpu_region_close(h)


def test_agents_dead_mark_is_the_shims_key(tmp_path: Path) -> None:
    path = tmp_path / "vgpu.region"
    m, h = _open_region(path, f"v1;claim=team-a/job;priority=0;dev={UUID0},3000,30")
    lib = m.lib
    pid = os.getpid()
    start = lib.vgpu_proc_start_time(pid)
    try:
        idx = lib.vgpu_region_join(h, pid, start)
        assert lib.vgpu_region_reserve(h, 0, 700 * MIB) == 0
        ns = lib.vgpu_pidns_self()
        me = os.stat("/proc/self/ns/pid")
        (ident,) = shimregion.slot_identities(path)
        assert (ident.index, ident.pid, ident.start_time) == (idx, pid, start)
        assert (ident.pidns_dev, ident.pidns_ino) == (ns.dev, ns.ino) == (me.st_dev, me.st_ino)
        assert lib.vgpu_region_reap(h.r) == 0  # a live process of our namespace: kept
        assert not shimregion.mark_slot_dead(path, idx, pid, start + 1)  # not this slot's process
        assert lib.vgpu_region_reap(h.r) == 0
        assert shimregion.mark_slot_dead(path, idx, pid, start)
        assert h.r.slot[idx].dead_key == shimregion.slot_key(pid, start)
        assert shimregion.slot_identities(path)[0].dead
        assert lib.vgpu_region_reap(h.r) == 1  # the agent's word frees it, charge and all
        assert shimregion.read_region(path).devices[0].used_mib == 0
    finally:
        lib.vgpu_region_close(h)


def test_not_a_region(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        shimregion.read_region(tmp_path / "missing")
    short = tmp_path / "short"
    short.write_bytes(b"\0" * 100)
    with pytest.raises(ValueError, match="smaller than"):
        shimregion.read_region(short)
    other = tmp_path / "other"
    other.write_bytes(b"\1" * shimregion.REGION_SIZE)
    with pytest.raises(ValueError, match="not a kvgpu region"):
        shimregion.read_region(other)
    assert not shimregion.set_host_pid(other, 1, 2, None)
    assert other.read_bytes() == b"\1" * shimregion.REGION_SIZE
