"""One region shared across PID namespaces (a DRA ResourceClaim referenced by two pods): one quota.

Each tenant is a Python process running the shim's own region code (the cffi build of
``vgpu_region.c``) as PID 1 of a private PID namespace (``unshare --pid --fork --mount-proc``,
root only), driven line by line over stdin/stdout. The node agent's part is the real
:func:`kvgpu.agent.slotresolver.resolve` over the host's real ``/proc``.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kvgpu import shimregion
from kvgpu.agent import slotresolver

from .conftest import MIB, ROOT, claim

TENANT = r"""
import os, subprocess, sys
sys.path.insert(0, sys.argv[2])
from kvgpu.shimcore import core
m = core(); ffi, lib = m.ffi, m.lib
cfg = ffi.new("struct vgpu_config *")
assert lib.vgpu_claim_parse(b"v1;claim=ns/shared;dev=GPU-x,100,0", cfg) == 0
h = ffi.new("struct vgpu_region_handle *")
assert lib.vgpu_region_open(h, sys.argv[1].encode(), cfg) == 0
kids = []
print("pid", os.getpid(), flush=True)
for line in sys.stdin:
    cmd, *arg = line.split()
    if cmd == "join":
        print("slot", lib.vgpu_region_join(h, os.getpid(), lib.vgpu_proc_start_time(os.getpid())), flush=True)
    elif cmd == "reserve":
        ok = lib.vgpu_region_reserve(h, 0, int(arg[0]) << 20) == 0
        print("ok" if ok else "refused", flush=True)
    elif cmd == "child":  # a sibling in this namespace that takes MiB and is then killed
        c = subprocess.Popen([sys.executable, "-c", sys.argv[3], sys.argv[1], sys.argv[2], arg[0]],
                             stdout=subprocess.PIPE, text=True)
        print(c.stdout.readline().strip(), flush=True)
        c.kill(); c.wait()
        print("killed", flush=True)
"""

SIBLING = r"""
import os, sys
sys.path.insert(0, sys.argv[2])
from kvgpu.shimcore import core
m = core(); ffi, lib = m.ffi, m.lib
h = ffi.new("struct vgpu_region_handle *")
assert lib.vgpu_region_attach(h, sys.argv[1].encode()) == 0
assert lib.vgpu_region_join(h, os.getpid(), lib.vgpu_proc_start_time(os.getpid())) >= 0
print("ok" if lib.vgpu_region_reserve(h, 0, int(sys.argv[3]) << 20) == 0 else "refused", flush=True)
import time; time.sleep(60)
"""


def _unshare() -> list[str]:
    cmd = ["unshare", "--pid", "--fork", "--mount-proc"]
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) for private PID namespaces")
    if subprocess.run([*cmd, "true"], capture_output=True).returncode != 0:
        pytest.skip("private PID namespaces are not allowed here")
    return cmd


class Tenant:
    """A process of its own PID namespace with a handle on the region."""

    def __init__(self, region: Path) -> None:
        self.p = subprocess.Popen([*_unshare(), sys.executable, "-c", TENANT, str(region), str(ROOT / "operator"),
                                   SIBLING], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.read() == "pid 1"  # PID 1 of its own namespace, as in a container

    def read(self) -> str:
        assert self.p.stdout is not None
        return self.p.stdout.readline().strip()

    def ask(self, line: str) -> str:
        assert self.p.stdin is not None
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()
        return self.read()

    def kill(self) -> None:
        """SIGKILL the whole namespace (unshare's child is its PID 1: the kernel ends the rest)."""
        for pid in _children(self.p.pid):
            os.kill(pid, signal.SIGKILL)
        self.p.kill()
        self.p.wait()


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(x) for x in (task / "children").read_text().split()]
    return out


@pytest.fixture
def region(core, tmp_path):
    path = tmp_path / "vgpu.region"
    tenants: list[Tenant] = []

    def tenant() -> Tenant:
        t = Tenant(path)
        tenants.append(t)
        assert int(t.ask("join").split()[1]) >= 0
        return t

    yield path, tenant
    for t in tenants:
        if t.p.poll() is None:
            t.kill()


def _used_mib(path: Path) -> float:
    return shimregion.read_region(path).devices[0].used_mib


def test_two_namespaces_cannot_pass_the_limit_together(region) -> None:
    path, tenant = region
    a, b = tenant(), tenant()  # both are PID 1 of their namespace
    assert a.ask("reserve 60") == "ok"
    # b's join and its refusal both reap: a's slot (PID 1 of another namespace) must survive them
    assert b.ask("reserve 60") == "refused"
    assert b.ask("reserve 40") == "ok"
    assert a.ask("reserve 1") == "refused"
    assert _used_mib(path) == 100
    slots = shimregion.slot_identities(path)
    assert len(slots) == 2 and len({(s.pidns_dev, s.pidns_ino) for s in slots}) == 2
    assert {s.pid for s in slots} == {1}


def test_agent_writes_host_pids_and_marks_nothing_live(region) -> None:
    path, tenant = region
    a, b = tenant(), tenant()
    assert a.ask("reserve 60") == "ok"
    result = slotresolver.resolve([path])
    assert (result.marked_dead, result.host_pids_written) == (0, 2)
    hosts = {s.host_pid for s in shimregion.slot_identities(path)}
    assert hosts == {_children(a.p.pid)[0], _children(b.p.pid)[0]}
    assert b.ask("reserve 60") == "refused"


def test_dead_tenant_of_another_namespace_is_reaped_only_after_the_agents_mark(region) -> None:
    path, tenant = region
    a, b = tenant(), tenant()
    assert a.ask("reserve 60") == "ok"
    a.kill()
    assert b.ask("reserve 60") == "refused"  # b cannot see a's namespace: the charge stays
    time.sleep(0.06)  # past VGPU_REAP_REFUSE_NS: b's next refusal reaps again
    assert b.ask("reserve 60") == "refused"
    result = slotresolver.resolve([path])
    assert result.marked_dead == 1
    time.sleep(0.06)
    assert b.ask("reserve 60") == "ok"
    assert _used_mib(path) == 60


def test_own_namespace_reaps_at_once(region) -> None:
    path, tenant = region
    a, b = tenant(), tenant()
    assert b.ask("reserve 10") == "ok"
    assert a.ask("child 50") == "ok"  # a sibling of a's namespace holds 50 MiB ...
    assert a.read() == "killed"  # ... and is SIGKILLed without leaving its slot
    assert _used_mib(path) == 60
    assert a.ask("reserve 90") == "ok"  # a reaps its own namespace's dead slot by /proc, no agent
    assert _used_mib(path) == 100


def _write_slot(path: Path, index: int, pid: int, start_time: int, ns: tuple[int, int], mib: int) -> None:
    """Fill a slot and the card total as a shim would (the test plays a tenant whose namespace
    the agent cannot see)."""
    fd = os.open(path, os.O_RDWR)
    try:
        with mmap.mmap(fd, shimregion.REGION_SIZE) as mm:
            r = shimregion.Region.from_buffer(mm)
            s = r.slot[index]
            s.pid, s.start_time, s.pidns_dev, s.pidns_ino = pid, start_time, ns[0], ns[1]
            s.data[0] = mib * MIB
            r.dev[0].used += mib * MIB
            del r, s
    finally:
        os.close(fd)


def test_slot_of_unknown_namespace_stays_charged(region) -> None:
    path, tenant = region
    b = tenant()
    _write_slot(path, 100, 4242, 7, (0, 0), 60)  # an older shim: no namespace recorded
    result = slotresolver.resolve([path])
    assert result.marked_dead == 0 and result.unresolved == 1
    time.sleep(0.06)
    assert b.ask("reserve 60") == "refused"


def test_namespace_without_processes_is_marked_and_a_late_mark_spares_a_new_holder(region) -> None:
    path, tenant = region
    b = tenant()
    gone = os.stat("/proc/self/ns/pid")
    _write_slot(path, 100, 4242, 7, (gone.st_dev, 1), 60)  # inode 1: no namespace has it
    assert slotresolver.resolve([path]).marked_dead == 1
    # the mark names (PID 4242, start 7): the same slot taken by another process is not reaped
    fd = os.open(path, os.O_RDWR)
    with mmap.mmap(fd, shimregion.REGION_SIZE) as mm:
        ctypes.c_uint64.from_buffer(mm, shimregion.Region.slot.offset + 100 * ctypes.sizeof(shimregion.Slot)
                                    + shimregion.Slot.start_time.offset).value = 8
    os.close(fd)
    time.sleep(0.06)
    assert b.ask("reserve 60") == "refused"
    assert shimregion.mark_slot_dead(path, 100, 4242, 8)
    time.sleep(0.06)
    assert b.ask("reserve 60") == "ok"


def test_preloaded_shim_in_two_namespaces_shares_one_quota(box) -> None:
    """The whole shim (LD_PRELOAD, stub driver): cuprog in two PID namespaces on one region."""
    un = [shutil.which("unshare") or "unshare", *_unshare()[1:]]
    env = box.env(claim((0, 1000, 0)))
    holder = subprocess.Popen([*un, str(box.kit.cuprog), "fill", "alloc", str(256 * MIB), "2", "60"], env=env,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None
        assert json.loads(holder.stdout.readline())["bytes"] == 512 * MIB

        runs = iter(range(2, 20))

        def fill() -> int:
            # each run another PID than the holder (1) and the runs before: the stub driver keys
            # its per-process usage by getpid(), which namespaces repeat
            cmd = "/bin/true; " * next(runs) + f"{box.kit.cuprog} fill alloc {64 * MIB}; exit $?"
            (r,) = box.json(*un, "/bin/sh", "-c", cmd, env=env)[:1]
            assert r["rc"] == 2, r  # stopped by the limit
            return int(r["bytes"]) // MIB

        assert fill() <= 1000 - 512 - 64  # the holder's 512 MiB and its context count here
        for pid in _children(holder.pid):
            os.kill(pid, signal.SIGKILL)
        holder.wait(10)
        assert fill() <= 1000 - 512 - 64  # gone, but from another namespace: charged until marked
        assert slotresolver.resolve([box.region]).marked_dead == 1
        assert fill() >= 1000 - 2 * 64 - 64  # all of it back, less this process's context
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
