"""The shared region through the cffi module: atomic admission, crash-safe lock, PID reuse."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time

import pytest

from .conftest import MIB, ROOT, claim

HOLDER = r"""
import os, sys, time
sys.path.insert(0, sys.argv[2])
from kvgpu.shimcore import core
m = core(); ffi, lib = m.ffi, m.lib
h = ffi.new("struct vgpu_region_handle *")
assert lib.vgpu_region_attach(h, sys.argv[1].encode()) == 0
assert lib.vgpu_region_join(h, os.getpid(), lib.vgpu_proc_start_time(os.getpid())) >= 0
assert lib.vgpu_region_reserve(h, 0, 100 << 20) == 0
lib.vgpu_region_lock(h.r)          # ... and die holding it
print("locked", flush=True)
time.sleep(60)
"""


def open_region(core, path, limit_mib: int):
    ffi, lib = core.ffi, core.lib
    cfg = ffi.new("struct vgpu_config *")
    assert lib.vgpu_claim_parse(f"v1;claim=a/b;dev=GPU-x,{limit_mib},0".encode(), cfg) == 0
    h = ffi.new("struct vgpu_region_handle *")
    assert lib.vgpu_region_open(h, str(path).encode(), cfg) == 0
    return h


def open_claim(core, path, text: str):
    """The region at path opened with claim text, or None when it is refused."""
    ffi, lib = core.ffi, core.lib
    cfg = ffi.new("struct vgpu_config *")
    assert lib.vgpu_claim_parse(text.encode(), cfg) == 0
    h = ffi.new("struct vgpu_region_handle *")
    return h if lib.vgpu_region_open(h, str(path).encode(), cfg) == 0 else None


def test_layout_is_stable(core) -> None:
    # docs/shim.md documents this size; the agent and older shims rely on it
    assert core.lib.vgpu_py_region_size() == core.ffi.sizeof("struct vgpu_region")
    assert core.ffi.offsetof("struct vgpu_region", "dev") == 480
    assert core.ffi.sizeof("struct vgpu_region_dev") == 168
    assert core.ffi.sizeof("struct vgpu_slot") == 304


def test_reserve_is_bounded_and_released(core, tmp_path) -> None:
    lib = core.lib
    h = open_region(core, tmp_path / "r", 100)
    assert lib.vgpu_region_join(h, os.getpid(), lib.vgpu_proc_start_time(os.getpid())) >= 0
    assert lib.vgpu_region_reserve(h, 0, 60 * MIB) == 0
    assert lib.vgpu_region_reserve(h, 0, 41 * MIB) == -1
    assert lib.vgpu_region_reserve(h, 0, 40 * MIB) == 0
    assert lib.vgpu_region_used(h.r, 0) == 100 * MIB
    lib.vgpu_region_release(h, 0, 60 * MIB)
    lib.vgpu_region_release(h, 0, 1 << 40)  # over-release clamps at what the slot holds
    assert lib.vgpu_region_used(h.r, 0) == 0
    assert lib.vgpu_region_set_overhead(h, 0, 120 * MIB) == 120 * MIB  # in full, even past the limit
    assert lib.vgpu_region_used(h.r, 0) == 120 * MIB
    assert lib.vgpu_region_reserve(h, 0, 1) == -1  # over the limit: nothing more
    lib.vgpu_region_leave(h)
    assert lib.vgpu_region_used(h.r, 0) == 0
    lib.vgpu_region_close(h)


def test_reconciliation_charges_every_listed_process_and_never_under(core, tmp_path) -> None:
    """Each slot NVML lists gets as overhead what NVML shows above its counted bytes: this
    process's and a sibling's of the same PID namespace, one of another namespace by the host PID
    the node agent wrote, none by a bare PID it cannot tell. A count that moved while NVML was
    asked is taken at its smaller value (and flagged): an allocation racing the query can only
    over-charge this process, and a sibling whose count moved is left to its own reconciliation.
    A sibling's overhead is only raised, never lowered from another's NVML answer."""
    lib, ffi = core.lib, core.ffi
    h = open_region(core, tmp_path / "r", 4000)
    me = os.getpid()
    assert lib.vgpu_region_join(h, me, lib.vgpu_proc_start_time(me)) >= 0
    sib = ffi.new("struct vgpu_region_handle *")
    sib.r, sib.fd = h.r, -1
    parent = os.getppid()  # alive, so the join does not reap it; a sibling of this namespace
    assert lib.vgpu_region_join(sib, parent, lib.vgpu_proc_start_time(parent)) >= 0
    other = ffi.new("struct vgpu_region_handle *")
    other.r, other.fd = h.r, -1
    assert lib.vgpu_region_join(other, 1, lib.vgpu_proc_start_time(1)) >= 0
    h.r.slot[other.slot].pidns_ino += 1  # another PID namespace, no host PID yet
    assert lib.vgpu_region_reserve(h, 0, 100 * MIB) == 0
    assert lib.vgpu_region_reserve(sib, 0, 200 * MIB) == 0
    before = ffi.new("uint64_t[128]")
    lib.vgpu_region_counted(h.r, 0, before)
    assert lib.vgpu_region_reserve(sib, 0, 50 * MIB) == 0  # while NVML is asked: not in its figure
    procs = ffi.new("struct vgpu_nvml_proc[3]", [(me, 164 * MIB), (parent, 700 * MIB), (1, 900 * MIB)])
    own, moved = lib.VGPU_RECON_OWN, lib.VGPU_RECON_MOVED
    assert lib.vgpu_region_reconcile(h, 0, before, procs, 3, lib.vgpu_pidns_self()) == own | moved
    assert h.r.slot[h.slot].overhead[0] == 64 * MIB
    assert h.r.slot[sib.slot].overhead[0] == 0  # its count moved under this pass: left to itself
    assert h.r.slot[other.slot].overhead[0] == 0  # PID 1 of another namespace: not ours to tell
    assert lib.vgpu_region_used(h.r, 0) == (100 + 64 + 250) * MIB
    h.r.slot[other.slot].host_pid = 1  # the agent wrote its host PID
    lib.vgpu_region_counted(h.r, 0, before)
    assert lib.vgpu_region_reconcile(h, 0, before, procs, 3, lib.vgpu_pidns_self()) == own
    assert h.r.slot[sib.slot].overhead[0] == 450 * MIB  # 700 - 250
    assert h.r.slot[other.slot].overhead[0] == 900 * MIB
    procs[0].used, procs[1].used = 100 * MIB, 300 * MIB  # an older answer, or memory given back
    assert lib.vgpu_region_reconcile(h, 0, before, procs, 3, lib.vgpu_pidns_self()) == own
    assert h.r.slot[h.slot].overhead[0] == 0  # its own figure is set
    assert h.r.slot[sib.slot].overhead[0] == 450 * MIB  # a sibling's is only raised
    assert lib.vgpu_region_reconcile(h, 0, before, procs + 1, 2, lib.vgpu_pidns_self()) == 0  # own not listed
    assert h.r.slot[h.slot].overhead[0] == 0  # kept
    lib.vgpu_region_to_overhead(h, 0, 60 * MIB)  # a charge the driver may still hold
    assert h.r.slot[h.slot].data[0] == 40 * MIB and h.r.slot[h.slot].overhead[0] == 60 * MIB
    assert lib.vgpu_region_used(h.r, 0) == (100 + 250 + 450 + 900) * MIB  # moved, not dropped
    lib.vgpu_region_close(h)


def test_sigkill_while_holding_the_lock(core, tmp_path) -> None:
    lib = core.lib
    path = tmp_path / "r"
    h = open_region(core, path, 300)
    child = subprocess.Popen([sys.executable, "-c", HOLDER, str(path), str(ROOT / "operator")],
                             stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "locked"
    assert lib.vgpu_region_used(h.r, 0) == 100 * MIB
    child.kill()
    child.wait()
    t0 = time.monotonic()
    assert lib.vgpu_region_join(h, os.getpid(), lib.vgpu_proc_start_time(os.getpid())) >= 0
    # the whole 300 MiB is ours again: the dead holder's 100 MiB came back with the lock
    assert lib.vgpu_region_reserve(h, 0, 300 * MIB) == 0
    assert time.monotonic() - t0 < 1.0
    lib.vgpu_region_leave(h)
    lib.vgpu_region_close(h)


def test_pid_reuse_does_not_inherit_charges(core, tmp_path) -> None:
    lib, ffi = core.lib, core.ffi
    h = open_region(core, tmp_path / "r", 100)
    me = os.getpid()
    # A slot that claims our PID but another start time: a dead process whose PID was reused.
    stale = ffi.new("struct vgpu_region_handle *")
    stale.r, stale.fd = h.r, -1
    assert lib.vgpu_region_join(stale, me, 12345) >= 0
    assert lib.vgpu_region_reserve(stale, 0, 90 * MIB) == 0
    assert lib.vgpu_region_join(h, me, lib.vgpu_proc_start_time(me)) >= 0  # reaps the impostor
    assert lib.vgpu_region_used(h.r, 0) == 0
    assert lib.vgpu_region_reserve(h, 0, 100 * MIB) == 0
    lib.vgpu_region_close(h)


def test_start_time_of_processes(core) -> None:
    lib = core.lib
    assert lib.vgpu_proc_start_time(os.getpid()) > 0
    p = subprocess.Popen(["sleep", "5"])
    st = lib.vgpu_proc_start_time(p.pid)
    assert st >= lib.vgpu_proc_start_time(os.getpid())
    p.kill()
    p.wait()
    assert lib.vgpu_proc_start_time(p.pid) == 0


def test_first_claim_fixes_the_limits(core, tmp_path) -> None:
    """Issue 14: a process presenting a bigger claim for the same region (a forged
    KVGPU_CLAIM) used to lift the limit of every process of the container ("latest claim
    wins"). The claim that created the region stays; another one is refused (EPERM)."""
    h1 = open_region(core, tmp_path / "r", 100)
    with pytest.raises(AssertionError):
        open_region(core, tmp_path / "r", 200)
    assert core.ffi.errno == errno.EPERM
    assert h1.r.dev[0].limit == 100 * MIB
    h2 = open_region(core, tmp_path / "r", 100)  # the same claim joins
    assert h2.r.dev[0].limit == 100 * MIB
    core.lib.vgpu_region_close(h1)
    core.lib.vgpu_region_close(h2)


@pytest.mark.parametrize("change", ["name", "priority", "uuid", "cores", "ndev"])
def test_any_other_claim_is_refused(core, tmp_path, change) -> None:
    base = "v1;claim=team-a/job;priority=1;dev=GPU-aaaa,100,30"
    other = {
        "name": "v1;claim=team-b/job;priority=1;dev=GPU-aaaa,100,30",
        "priority": "v1;claim=team-a/job;priority=0;dev=GPU-aaaa,100,30",
        "uuid": "v1;claim=team-a/job;priority=1;dev=GPU-bbbb,100,30",
        "cores": "v1;claim=team-a/job;priority=1;dev=GPU-aaaa,100,0",
        "ndev": "v1;claim=team-a/job;priority=1;dev=GPU-aaaa,100,30;dev=GPU-bbbb,100,30",
    }[change]
    h = open_claim(core, tmp_path / "r", base)
    assert h is not None
    assert open_claim(core, tmp_path / "r", other) is None and core.ffi.errno == errno.EPERM
    assert open_claim(core, tmp_path / "r", base) is not None


def test_agent_reads_the_shims_oom_kill(box) -> None:
    """The real shim on the stub kills the process whose hidden memory takes the container over
    1000 MiB (ACTIVE_OOM_KILLER); the agent's reader sees the count, the victim and the charge."""
    from kvgpu.agent.usage import OomKills, default_reader

    env = box.env(claim((0, 1000, 0)), ACTIVE_OOM_KILLER="true")
    p = box.run(str(box.kit.stubdir / "memprog"), "hidden", "5", str(64 * MIB), "800", "0", env=env,
                check=False)
    assert p.returncode == -signal.SIGKILL, p.stderr
    rows = default_reader()(box.region.parent)
    assert rows is not None and rows.oom is not None
    held = 5 * 64 + 64 + 800  # MiB: 5 allocations, the context, the hidden 800 (all one process)
    assert rows.oom == OomKills(1, rows.oom.generation, rows.oom.last_pid, 0, held, held, 1000.0)
    assert rows.oom.last_pid > 0 and rows.oom.generation >= 1
