"""Memory limit through the shim, on the stub card (4096 MiB, 64 MiB context, 2 MiB pages).

Every allocation path stops at the limit with CUDA_ERROR_OUT_OF_MEMORY (2); the context is
charged after NVML reconciliation; reported totals agree; NULL pointers behave as without the
shim; devices are found by UUID whatever CUDA_VISIBLE_DEVICES says.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .conftest import MIB, claim, uuid

# vmmmapped: each handle released while still mapped; vmmretained: released, retained from its
# mapping, unmapped (the driver keeps the memory of both); vmmarray / vmmarrayunmap: mapped into a
# sparse array's tiles and released (freed by destroying the array / by unmapping the tiles);
# vmmarraypartial: the map call fails after its first operation mapped the tiles; vmmarrayrace: the
# tenant's operation list is rewritten (its array gone) right after the driver read it; array8:
# 1-byte elements, which the stub lays out in 4 bytes each while the driver, as a real one, gives
# no memory requirements for such an array (the shim's estimate is a quarter of what NVML shows)
PATHS = ["alloc", "managed", "pitch", "async", "pool", "vmm", "vmmmapped", "vmmretained", "vmmarray",
         "vmmarrayunmap", "vmmarraypartial", "vmmarrayrace", "array", "array3d", "array8",
         "mipmap", "gpa", "gpa_v1", "dlsym", "v1abi", "pitch_v1", "array_v1", "array3d_v1"]
CHUNK = 64 * MIB


@pytest.mark.parametrize("path", PATHS)
def test_every_path_stops_at_the_limit(box, path: str) -> None:
    native = box.json("fill", path, str(CHUNK), "20", env=box.env(shim=False))[0]
    assert native["n"] == 20  # the stub card alone would allow more
    out = box.json("fill", path, str(CHUNK), env=box.env(claim((0, 1000, 0))))
    first, after = out
    # 1000 MiB - 64 MiB context = 936 MiB -> 14 chunks of 64 MiB, the 15th is refused
    assert first["n"] == 14 and first["rc"] == 2
    assert first["total"] == 1000 * MIB and first["free"] <= 1000 * MIB - (14 * 64 + 64) * MIB
    assert after["free"] == 1000 * MIB - 64 * MIB  # freed memory returns; the context stays


@pytest.mark.parametrize("path", ["sparse", "deferred", "sparsemip"])
def test_an_array_mapped_in_later_is_not_charged_itself(box, path: str) -> None:
    """A sparse or deferred-mapping array has no memory of its own: its tiles are handles mapped
    in later, charged at their cuMemCreate (the vmmarray paths above), so creating one charges
    nothing. 30 arrays of 64 MiB each under a 1000 MiB limit."""
    out = box.json("fill", path, str(CHUNK), "30", env=box.env(claim((0, 1000, 0))))[0]
    assert out["n"] == 30 and out["rc"] == 0
    assert out["free"] == 1000 * MIB - 64 * MIB  # the context only


def test_a_handle_mapped_in_anothers_place_keeps_its_charge(box) -> None:
    """One cuMemMapArrayAsync call may unmap a sparse array's tiles and map another handle in
    their place: the unmap ends the mapping made before it, never the one after it in the same
    call. Each chunk: handle A mapped and released, then (unmap, map B) in one call, B released;
    the array holds B. Read from the region while held: B counted as data, none of it left to
    NVML reconciliation as overhead (numbered maps-before-unmaps, the unmap ended B too)."""
    from kvgpu.shimcore import read_region

    env = box.env(claim((0, 1000, 0)))
    holder = subprocess.Popen([str(box.kit.cuprog), "fill", "vmmarrayremap", str(CHUNK), "4", "30"], env=env,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert json.loads(holder.stdout.readline())["n"] == 4
        p = read_region(box.region).devices[0].processes[0]
        assert p.data_mib == 4 * 64 + 64 and p.overhead_mib == 0, p  # four B handles and the context
    finally:
        holder.kill()
        holder.wait()
    # at the limit: the 14th chunk's B would pass it while its A is still mapped, so 13 are granted
    first, after = box.json("fill", "vmmarrayremap", str(CHUNK), env=box.env(claim((0, 1000, 0))))
    assert first["n"] == 13 and first["rc"] == 2, first
    assert after["free"] == 1000 * MIB - 64 * MIB  # the arrays destroyed: every charge returned


def test_gpa_indirect_pointers_still_hooked(box) -> None:
    """A driver whose cuGetProcAddress returns non-exported addresses: name/version fallback."""
    out = box.json("fill", "gpa", str(CHUNK), env=box.env(claim((0, 1000, 0)), STUB_GPA_INDIRECT=1))
    assert out[0]["n"] == 14 and out[0]["rc"] == 2


def test_pitch_is_charged_with_the_real_pitch(box) -> None:
    # The stub pads rows to 2 KiB. 1100 B x 130000 rows: estimate (512 B rows) 136 MiB fits in
    # 300 - 64 = 236 MiB, the real 2048 B pitch (254 MiB) does not.
    assert box.json("pitch", "1100", "130000", env=box.env(shim=False))[0] == {"rc": 0, "pitch": 2048}
    assert box.json("pitch", "1100", "130000", env=box.env(claim((0, 300, 0))))[0]["rc"] == 2
    assert box.json("pitch", "1100", "100000", env=box.env(claim((0, 300, 0))))[0]["rc"] == 0


def test_the_pre_3_2_memory_info_reports_the_slice(box) -> None:
    """cuMemGetInfo / cuDeviceTotalMem of the 32-bit ABI, reached through cuGetProcAddress with
    an old cudaVersion, show the slice as the v2 entry points do (the physical card: 4 GiB - 1)."""
    native = box.json("info_v1", env=box.env(shim=False))[0]
    assert native["rc"] == 0 and native["total"] == native["totalmem"] == 2**32 - 1
    out = box.json("info_v1", env=box.env(claim((0, 1000, 0))))[0]
    assert out == {"rc": 0, "free": 936 * MIB, "total": 1000 * MIB, "totalmem_rc": 0, "totalmem": 1000 * MIB}


def test_small_limit_300_mib_works(box) -> None:
    info = box.json("info", env=box.env(claim((0, 300, 0))))[0]
    assert info["rc"] == 0 and info["total"] == 300 * MIB and info["totalmem"] == 300 * MIB
    assert info["free"] == (300 - 64) * MIB
    out = box.json("fill", "alloc", str(16 * MIB), env=box.env(claim((0, 300, 0))))[0]
    assert out["n"] == 14 and out["rc"] == 2  # 236 MiB / 16


def test_limit_below_the_context_refuses_the_context(box) -> None:
    """Context 256 MiB > limit 100 MiB: the context is charged in full when it is created (NVML
    shows what it took), so creating it fails with CUDA_ERROR_OUT_OF_MEMORY."""
    env = box.env(claim((0, 100, 0)), STUB_CTX_MIB=256)
    p = box.run("info", env=env, check=False)
    assert p.returncode == 3 and json.loads(p.stdout) == {"ctx_rc": 2}
    assert "context refused: it took 256 MiB" in p.stderr


@pytest.mark.parametrize("others", [0, 200])
def test_overhead_is_charged_in_full(box, others) -> None:
    """Memory NVML shows above the counted allocations (here a 600 MiB context, 60 % of the
    limit) is charged in full: before, the charge was capped at half the limit (500 MiB).
    others: more processes on the card than a 128-entry list holds, listed first (a tenant can
    start them); the process was not found and nothing hidden was charged (free 1000 MiB)."""
    env = box.env(claim((0, 1000, 0)), STUB_CTX_MIB=600, STUB_NVML_FAKE_PROCS=str(others))
    info = box.json("info", env=env)[0]
    assert info["free"] == 400 * MIB
    out = box.json("fill", "alloc", str(CHUNK), env=env)[0]
    assert out["n"] == 6 and out["rc"] == 2  # 400 / 64, not 500 / 64 = 7


def test_limit_above_physical_reports_physical(box) -> None:
    info = box.json("info", env=box.env(claim((0, 10000, 0))))[0]
    assert info["total"] == 4096 * MIB and info["totalmem"] == 4096 * MIB


def test_null_pointers_like_the_driver(box) -> None:
    native = box.json("null", env=box.env(shim=False))[0]
    shimmed = box.json("null", env=box.env(claim((0, 1000, 0))))[0]
    for k in ("null_free_rc", "null_total_rc", "both_null_rc", "totalmem_null_rc"):
        assert shimmed[k] == native[k], k
    assert shimmed["total"] == 1000 * MIB and shimmed["free"] == (1000 - 64) * MIB


NVML_PROBE = r"""
import ctypes, json, sys
class M1(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]
class M2(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint), ("total", ctypes.c_ulonglong), ("reserved", ctypes.c_ulonglong),
                ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]
cu = ctypes.CDLL("libcuda.so.1")
nv = ctypes.CDLL("libnvidia-ml.so.1")
assert cu.cuInit(0) == 0
dev, ctx, ptr = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_ulonglong()
cu.cuDeviceGet(ctypes.byref(dev), 0)
cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)
cu.cuCtxSetCurrent(ctx)
assert cu.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(int(sys.argv[1]) << 20)) == 0
f, t, tm = ctypes.c_size_t(), ctypes.c_size_t(), ctypes.c_size_t()
cu.cuMemGetInfo_v2(ctypes.byref(f), ctypes.byref(t))
cu.cuDeviceTotalMem_v2(ctypes.byref(tm), dev)
assert nv.nvmlInit_v2() == 0
h = ctypes.c_void_p()
nv.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(h))
m1, m2 = M1(), M2()
m2.version = (2 << 24) | ctypes.sizeof(M2)
r1 = nv.nvmlDeviceGetMemoryInfo(h, ctypes.byref(m1))
r2 = nv.nvmlDeviceGetMemoryInfo_v2(h, ctypes.byref(m2))
rn = nv.nvmlDeviceGetMemoryInfo(h, None)
print(json.dumps(dict(cu_free=f.value, cu_total=t.value, totalmem=tm.value, r1=r1, r2=r2, rnull=rn,
    v1=[m1.total, m1.used, m1.free], v2=[m2.total, m2.used, m2.free, m2.reserved])))
"""


def test_cuda_and_nvml_totals_agree(box) -> None:
    env = box.env(claim((0, 3000, 0)))
    p = box.run(sys.executable, "-c", NVML_PROBE, "512", env=env)
    o = json.loads(p.stdout)
    total = 3000 * MIB
    assert o["r1"] == 0 and o["r2"] == 0 and o["rnull"] == 2  # NULL: INVALID_ARGUMENT, as NVML
    assert o["cu_total"] == o["totalmem"] == o["v1"][0] == o["v2"][0] == total
    used = (512 + 64) * MIB
    assert o["v1"][1] == o["v2"][1] == used and o["v2"][3] == 0
    assert o["v1"][2] == o["v2"][2] == o["cu_free"] == total - used
    native = json.loads(box.run(sys.executable, "-c", NVML_PROBE, "512", env=box.env(shim=False)).stdout)
    assert native["v1"][0] == 4096 * MIB  # the probe itself sees the whole stub card without the shim


def test_nvml_view_never_underflows(box) -> None:
    """Charged more than the limit (overhead cap hit): used is capped at total, free is 0."""
    env = box.env(claim((0, 100, 0)), STUB_CTX_MIB=40)
    o = json.loads(box.run(sys.executable, "-c", NVML_PROBE, "60", env=env).stdout)
    assert o["v1"][0] == 100 * MIB and o["v1"][1] <= 100 * MIB and o["v1"][2] <= 100 * MIB
    assert o["v1"][1] + o["v1"][2] == 100 * MIB


@pytest.mark.parametrize(
    "visible, expect_total, expect_last",
    [(None, 500, 0), ("0", 500, 0), ("1", 1500, 1), ("1,0", 1500, 1), (uuid(1), 1500, 1)],
)
def test_devices_mapped_by_uuid(box, visible, expect_total, expect_last) -> None:
    extra = {"STUB_NDEV": 2}
    if visible is not None:
        extra["CUDA_VISIBLE_DEVICES"] = visible
    info = box.json("info", env=box.env(claim((0, 500, 0), (1, 1500, 0)), **extra))[0]
    assert info["uuid_last"] == expect_last and info["total"] == expect_total * MIB
    assert info["totalmem"] == expect_total * MIB


def test_second_visible_device_has_its_own_limit(box) -> None:
    env = box.env(claim((0, 500, 0), (1, 1500, 0)), STUB_NDEV=2, CUDA_VISIBLE_DEVICES="1,0")
    info1 = box.json("info", "1", env=env)[0]  # ordinal 1 = physical card 0
    assert info1["uuid_last"] == 0 and info1["total"] == 500 * MIB


@pytest.mark.parametrize("path", ["async", "pool", "poolmade", "poolalias"])
def test_stream_ordered_memory_is_charged_to_the_card_it_is_on(box, path) -> None:
    """With card 0's context current, memory allocated on a stream of card 1's context, or from
    card 1's default pool or a pool made on it, is on card 1: it counts against card 1's limit
    (1500 MiB - its context = 22 chunks), not card 0's (500 MiB: 6 chunks), and card 0 keeps its
    room. Charged to the current card, a tenant could put another card's whole limit on card 1.
    poolalias: cuMemPoolCreate's new handle is written over the properties' location; read back
    after the driver, the location looked like the host's and the pool's memory went uncharged."""
    env = box.env(claim((0, 500, 0), (1, 1500, 0)), STUB_NDEV=2)
    o = box.json("xdev", path, str(CHUNK), env=env)[0]
    assert o["n"] == (1500 - 64) // 64 and o["rc"] == 2, o
    assert o["total0"] == 500 * MIB and o["free0"] == (500 - 64) * MIB, o
    assert o["total1"] == 1500 * MIB and o["free1"] == (1500 - 64 - o["n"] * 64) * MIB, o
    assert o["free1_after"] == (1500 - 64) * MIB, o


@pytest.mark.parametrize("how", ["reset", "release", "destroy"])
@pytest.mark.parametrize("managed", ["0", "1"])
def test_memory_a_context_took_with_it_is_no_longer_charged(box, how, managed) -> None:
    """A context's end frees the memory allocated in it (cudaDeviceReset, the primary context's
    last release, cuCtxDestroy), and the program never frees those pointers: the same fill fits
    again in the next context. Before, their charges stayed until the process exited and the
    second fill was refused at once (0 chunks). Managed memory too: on the H200 (driver 580,
    bench/gpu/reset_probe.py) a reset and a cuCtxDestroy each freed a 1 GiB cuMemAllocManaged
    whose pages were on the card, and a later cuMemFree of it failed; it stayed charged."""
    env = box.env(claim((0, 1000, 0)), CUPROG_MANAGED=managed)
    o = box.json("ctxend", how, str(CHUNK), env=env)[0]
    ctxs = 2 if how == "destroy" else 1  # a created context beside the primary one
    assert o["end_rc"] == 0 and o["ctx2_rc"] == 0, o
    assert o["n1"] == (1000 - 64 * ctxs) // 64 and o["rc1"] == 2, o
    assert o["n2"] == o["n1"] and o["rc2"] == 2, o


def test_an_exported_allocation_stays_charged_after_its_release(box) -> None:
    """Review finding from the H200 (bench/gpu/reset_probe.py): a cuMemCreate exported as a file
    descriptor keeps its memory on the card after cuMemRelease while the descriptor is open,
    and NVML's process list no longer shows it, so neither reconciliation nor the agent could
    see what the release uncharged. Created, exported and released in a loop, every round fitted
    (64 of 256 MiB under 1000 MiB). An exported handle now stays charged until the process
    ends; a handle released without an export still returns its charge."""
    env = box.env(claim((0, 1000, 0)))
    o = box.json("vmmexport", "1", str(256 * MIB), env=env)[0]
    assert o["export_rc"] == 0 and o["rc"] == 2 and o["n"] == (1000 - 64) // 256, o
    o = box.json("vmmexport", "0", str(256 * MIB), env=env)[0]
    assert o["n"] == 64 and o["rc"] == 0, o


def test_an_allocation_made_while_a_context_ends_stays_charged(box) -> None:
    """Another thread retains the primary context again (the driver hands back the same handle)
    and allocates in it while the reset that ended it is still returning: that allocation is
    live and must stay charged. Dropped by handle after the reset, it went uncharged: the
    container's free memory after the next fill read 56 MiB more than it had."""
    env = box.env(claim((0, 1020, 0)), STUB_ALLOC_IN_RESET="56")  # 60 MiB left after the first fill
    o = box.json("ctxend", "reset", str(CHUNK), env=env)[0]
    assert o["end_rc"] == 0 and o["n1"] == (1020 - 64) // 64, o
    assert o["n2"] == o["n1"] and o["rc2"] == 2, o
    assert o["free2"] == (1020 - 64 - 56 - 64 * o["n2"]) * MIB, o


def test_a_context_still_retained_keeps_its_memory_charged(box) -> None:
    """A release that is not the last (the context and its memory live on) returns nothing,
    whatever the shim counted: a retain it did not see must not let a tenant drop its charges."""
    env = box.env(claim((0, 1000, 0)))
    o = box.json("ctxend", "release2", str(CHUNK), env=env)[0]
    assert o["end_rc"] == 0 and o["n1"] == (1000 - 64) // 64, o
    assert o["n2"] == 0 and o["rc2"] == 2, o


def test_device_outside_the_claim_is_refused(box) -> None:
    """Not even a context: it would hold memory on a card the container has no claim on."""
    env = box.env(claim((1, 1500, 0)), STUB_NDEV=2, CUDA_VISIBLE_DEVICES="0")
    p = box.run("fill", "alloc", str(CHUNK), env=env, check=False)
    assert p.returncode == 3 and json.loads(p.stdout) == {"ctx_rc": 2}


def test_processes_of_a_container_share_one_quota(box) -> None:
    env = box.env(claim((0, 1000, 0)))
    holder = subprocess.Popen([str(box.kit.cuprog), "fill", "alloc", str(CHUNK), "5", "30"], env=env,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert json.loads(holder.stdout.readline())["n"] == 5
        # 1000 - 2 contexts (128) - 5 x 64 (320) = 552 MiB left -> 8 chunks
        out = box.json("fill", "alloc", str(CHUNK), env=env)[0]
        assert out["n"] == 8 and out["rc"] == 2
    finally:
        holder.kill()
        holder.wait()


def test_racing_processes_never_exceed_the_limit(box) -> None:
    """N processes allocate 2 MiB chunks at the same instant; the total stays within the limit.
    (2 MiB: the stub's page, so no rounding overhead enters the charge.)"""
    limit, n = 200, 6
    env = box.env(claim((0, limit, 0)), STUB_CTX_MIB=0)
    go = box.dir / "go"
    procs = [subprocess.Popen([str(box.kit.cuprog), "race", str(2 * MIB), str(go)], env=env,
                              stdout=subprocess.PIPE, text=True) for _ in range(n)]
    time.sleep(0.5)
    go.touch()
    totals = [json.loads(p.communicate(timeout=60)[0])["bytes"] for p in procs]
    assert sum(totals) <= limit * MIB
    assert sum(totals) == limit * MIB  # and nothing is lost: the last page is handed out
    assert min(totals) >= 0 and len(totals) == n


def test_sigkilled_process_returns_its_memory(box) -> None:
    env = box.env(claim((0, 1000, 0)))
    holder = subprocess.Popen([str(box.kit.cuprog), "fill", "alloc", str(CHUNK), "10", "60"], env=env,
                              stdout=subprocess.PIPE, text=True)
    assert json.loads(holder.stdout.readline())["n"] == 10
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    out = box.json("fill", "alloc", str(CHUNK), env=env)[0]
    assert out["n"] == 14  # the dead process's 10 chunks and context came back


def test_region_is_readable_by_the_agent(box, core) -> None:
    from kvgpu.shimcore import read_region

    env = box.env(claim((0, 1000, 25), name="ns1/claim-a", priority=0))
    holder = subprocess.Popen([str(box.kit.cuprog), "fill", "alloc", str(CHUNK), "3", "30"], env=env,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert json.loads(holder.stdout.readline())["n"] == 3
        r = read_region(box.region)
        assert r.claim == "ns1/claim-a" and r.priority == 0 and len(r.devices) == 1
        d = r.devices[0]
        assert d.uuid == uuid(0) and d.limit_mib == 1000 and d.cores == 25
        assert d.pids == (holder.pid,)
        # the context is counted when it is created (what NVML shows it took), not as overhead
        assert d.used_mib == 3 * 64 + 64 and d.processes[0].data_mib == 192 + 64
        assert d.processes[0].overhead_mib == 0
    finally:
        holder.kill()
        holder.wait()
    with pytest.raises(FileNotFoundError):
        read_region(box.dir / "missing")
    bad = box.dir / "bad.region"
    bad.write_bytes(b"\0" * 100)
    with pytest.raises(ValueError):
        read_region(bad)


def test_no_claim_means_pass_through(box) -> None:
    out = box.json("fill", "alloc", str(CHUNK), "40", env=box.env())[0]
    assert out["n"] == 40 and out["total"] == 4096 * MIB
    assert not Path(box.region).exists()


def test_graph_memory_is_charged_through_nvml(box) -> None:
    """Graph memory nodes (here 300 MiB at the first graph launch) appear only in NVML's
    per-process usage; reconciliation charges them, and a graph launch over the limit fails."""
    env = box.env(claim((0, 1000, 0)), STUB_GRAPH_MEM_MIB=300)
    o = box.json("graphmem", "0", str(CHUNK), env=env)[0]
    assert o["graph1_rc"] == 0 and o["graph2_rc"] == 0
    assert o["more"] == 9  # (1000 - 64 context - 300 graph) / 64, not 14
    over = box.json("graphmem", "10", str(CHUNK), env=box.env(claim((0, 1000, 0)), STUB_GRAPH_MEM_MIB=600))[0]
    assert over["graph1_rc"] == 0 and over["graph2_rc"] == 2 and over["more"] == 0


def test_hami_env_mode(box) -> None:
    env = box.env(CUDA_DEVICE_MEMORY_LIMIT_0="500m", CUDA_DEVICE_MEMORY_LIMIT_1="1g", STUB_NDEV=2)
    assert box.json("info", env=env)[0]["total"] == 500 * MIB
    assert box.json("info", "1", env=env)[0]["total"] == 1024 * MIB
    out = box.json("fill", "alloc", str(CHUNK), env=env)[0]
    assert out["n"] == 6 and out["rc"] == 2  # (500 - 64) / 64
    o = json.loads(box.run(sys.executable, "-c", NVML_PROBE, "100", env=env).stdout)
    assert o["v1"][0] == o["v2"][0] == o["cu_total"] == 500 * MIB  # NVML by index in HAMi mode
    shared = box.env(CUDA_DEVICE_MEMORY_LIMIT="300m", CUDA_DEVICE_MEMORY_SHARED_CACHE=box.dir / "h.cache")
    del shared["KVGPU_REGION_DIR"]  # that one would win
    assert box.json("info", env=shared)[0]["total"] == 300 * MIB
    assert (box.dir / "h.cache").exists()


def test_dead_process_leaves_the_nvml_view(box) -> None:
    env = box.env(claim((0, 2000, 0)))
    holder = subprocess.Popen([str(box.kit.cuprog), "fill", "alloc", str(CHUNK), "10", "60"], env=env,
                              stdout=subprocess.PIPE, text=True)
    assert json.loads(holder.stdout.readline())["n"] == 10
    holder.kill()
    holder.wait()
    o = json.loads(box.run(sys.executable, "-c", NVML_PROBE, "64", env=env).stdout)
    assert o["v1"][1] == (64 + 64) * MIB  # only the probe's own context and chunk
