"""Memory the allocation hooks do not see (issue 21), on the stub card (4096 MiB, 64 MiB
contexts, 2 MiB pages): graph memory nodes, extra contexts, context limits (malloc heap, stack),
and memory that only NVML shows. Each is charged before the driver is asked or refused; what
the shim cannot refuse ends the process with ACTIVE_OOM_KILLER=true.
"""

from __future__ import annotations

import json
import signal
import struct
import subprocess

import pytest

from .conftest import MIB, claim

CHUNK = 64 * MIB


def memprog(box, *args: str, env, check: bool = True) -> subprocess.CompletedProcess[str]:
    return box.run(str(box.kit.stubdir / "memprog"), *args, env=env, check=check)


def last(p: subprocess.CompletedProcess[str]) -> dict:
    return [json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")][-1]


def oom_kills(box) -> tuple[int, int, int]:
    """(oom_kills, oom_last_pid, oom_last_bytes) from the region header (offset 416)."""
    kills, pid, _dev, nbytes = struct.unpack_from("<QiIQ", box.region.read_bytes(), 416)
    return kills, pid, nbytes


@pytest.mark.parametrize("mode", ["add", "capture", "child"])
def test_graph_memory_nodes_charged_at_the_first_launch(box, mode: str) -> None:
    """300 MiB of memory nodes, however the graph got them, are charged at the first launch and
    returned once the allocation is freed and the executable graph destroyed."""
    o = last(memprog(box, "graph", mode, "300", str(CHUNK), env=box.env(claim((0, 1000, 0)))))
    assert o["inst_rc"] == 0 and o["launch1_rc"] == 0 and o["launch2_rc"] == 0
    assert o["more"] == 9  # (1000 - 64 context - 300 graph) / 64
    assert o["destroy_rc"] == 0 and o["after"] == 14


@pytest.mark.parametrize("mode", ["add", "capture"])
def test_a_graph_allocation_left_live_stays_charged_after_its_graph(box, mode: str) -> None:
    """Graph destruction does not free a live graph allocation (CUDA's graph memory nodes; the
    stub models it): the executable graph destroyed, its 300 MiB still held, the slice's other
    allocations must not take them again. Before, the destroy returned the charge and the
    reconciliation came too late: 14 chunks granted beside the live 300 MiB (1260 MiB held
    under 1000)."""
    o = last(memprog(box, "graph", mode, "300", str(CHUNK), "keep", env=box.env(claim((0, 1000, 0)))))
    assert o["launch1_rc"] == 0 and o["more"] == 9 and o["destroy_rc"] == 0
    assert o["after"] == 9  # the live 300 MiB still count: (1000 - 64 - 300) / 64


def test_an_idle_siblings_hidden_memory_is_charged(box) -> None:
    """A process takes 500 MiB the hooks do not see (a device malloc, a module's globals) and
    then makes no CUDA call: its own reconciliation never runs. Another process of the container
    reconciles the whole container from NVML's process list when it allocates, so it gets what
    the limit leaves. Before, each process reconciled only itself: the second got 13 chunks,
    1460 MiB held under 1000."""
    env = box.env(claim((0, 1000, 0)))
    idle = subprocess.Popen([str(box.kit.stubdir / "memprog"), "hide", "500", "20"], env=env,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert json.loads(idle.stdout.readline())["hidden"] == 500
        p = memprog(box, "hidden", "20", str(CHUNK), "0", "0", env=env)
        # (1000 - 64 - 500 - 64) / 64: both contexts and the idle process's hidden 500 MiB
        assert json.loads(p.stdout.splitlines()[0])["n"] == 5
    finally:
        idle.kill()
        idle.wait()


def test_an_allocation_made_while_its_capture_ended_is_charged(box) -> None:
    """Into a capturing stream an allocation is a graph node, charged at the graph's launch; the
    stub ends the capture between the shim's check and the driver (another thread's
    cuStreamEndCapture in relaxed mode), so the memory is made at once. It is charged after the
    driver returns (refused and freed when it does not fit). Before, all four 512 MiB
    allocations were made uncharged."""
    env = box.env(claim((0, 1000, 0)), STUB_CAPTURE_ENDS_AFTER_CHECK="1")
    o = last(memprog(box, "capalloc", "4", "512", str(CHUNK), env=env))
    assert o["ok"] == 1  # the first 512 MiB fit beside the context, the next three are refused
    assert o["more"] == 6  # (1000 - 64 - 512) / 64


def test_a_captured_free_of_a_graph_never_launched_keeps_the_charge(box) -> None:
    """cuMemFreeAsync into a capturing stream is a node of the graph: the memory lives on until
    the graph runs. Freed into four graphs never launched, 4 x 200 MiB stay charged. Before, the
    capture uncharged them and 14 chunks were granted beside them (1760 MiB under 1000)."""
    o = last(memprog(box, "capfree", "4", "200", str(CHUNK), env=box.env(claim((0, 1000, 0)))))
    assert o["ok"] == 4 and o["more"] == 2  # (1000 - 64 - 800) / 64


@pytest.mark.parametrize("mode", ["add", "capture", "child"])
def test_graph_launch_over_the_limit_is_refused(box, mode: str) -> None:
    """The H200 case: a 2 GiB memory node under a 1000 MiB limit. Without the shim the card has
    room; with it the launch is refused, nothing is charged, allocations still fill the slice."""
    native = last(memprog(box, "graph", mode, "2048", str(CHUNK), env=box.env(shim=False)))
    assert native["launch1_rc"] == 0
    o = last(memprog(box, "graph", mode, "2048", str(CHUNK), env=box.env(claim((0, 1000, 0)))))
    assert o["inst_rc"] == 0 and o["launch1_rc"] == 2 and o["launch2_rc"] == 2
    assert o["more"] == 14 and o["after"] == 14


@pytest.mark.parametrize("abi", ["v2", "v1"])
def test_extra_contexts_are_charged_and_refused(box, abi: str) -> None:
    # 300 MiB: the primary context (64) and 3 more fit, the 5th and 6th do not (v1: the CUDA
    # < 3.2 cuCtxCreate a program reaches through cuGetProcAddress with an old cudaVersion)
    o = last(memprog(box, "ctx", "5", str(16 * MIB), abi, env=box.env(claim((0, 300, 0)))))
    assert o["ctx_rc"] == [0, 0, 0, 2, 2]
    assert o["more"] == 2  # (300 - 4 x 64) / 16
    assert o["after"] == 14  # destroyed contexts give their memory back: (300 - 64) / 16


def test_green_contexts_are_charged_and_refused(box) -> None:
    """Green contexts (cuGreenCtxCreate) take memory no allocation hook sees: each is charged what
    NVML shows it took (the stub: 32 MiB), refused when that does not fit, and returned when it is
    destroyed. Before, six of them took 192 MiB past a 300 MiB limit uncharged."""
    o = last(memprog(box, "green", "8", str(16 * MIB), env=box.env(claim((0, 300, 0)))))
    # the primary context (64) and 7 green ones (224) fit in 300, the 8th does not
    assert o["desc_rc"] == 0 and o["green_rc"] == [0] * 7 + [2]
    assert o["more"] == 0  # (300 - 64 - 7 x 32) / 16
    assert o["after"] == 14  # destroyed, they give their memory back: (300 - 64) / 16
    native = last(memprog(box, "green", "8", str(16 * MIB), env=box.env(shim=False)))
    assert native["green_rc"] == [0] * 8  # the stub card itself has room for them


def test_three_extra_contexts_then_allocations(box) -> None:
    """The issue's case on the stub: 3 extra contexts, then allocations, stay within the limit."""
    o = last(memprog(box, "ctx", "3", str(CHUNK), env=box.env(claim((0, 1000, 0)))))
    assert o["ctx_rc"] == [0, 0, 0] and o["more"] == 11  # (1000 - 4 x 64) / 64


def test_malloc_heap_and_stack_limits_are_charged(box) -> None:
    env = box.env(claim((0, 1000, 0)))
    o = last(memprog(box, "limit", "2", str(512 * MIB), str(CHUNK), env=env))  # heap 8 -> 512 MiB
    assert o["limit_rc"] == 0 and o["more"] == 6  # (1000 - 64 - 504) / 64
    o = last(memprog(box, "limit", "2", str(2048 * MIB), str(CHUNK), env=env))  # does not fit
    assert o["limit_rc"] == 2 and o["more"] == 14
    o = last(memprog(box, "limit", "0", "16384", str(CHUNK), env=env))  # stack x 4096 threads: 60 MiB
    assert o["limit_rc"] == 0 and o["more"] == 13  # (1000 - 64 - 60) / 64
    native = last(memprog(box, "limit", "2", str(2048 * MIB), str(CHUNK), env=box.env(shim=False)))
    assert native["limit_rc"] == 0


def test_device_runtime_limits_are_reconciled_and_refused(box) -> None:
    """The device runtime's sync depth and pending launch count (cuCtxSetLimit 3 and 4) make the
    driver reserve memory it does not tell (the stub: 8 MiB a level, 4 KiB a launch): reconciled
    right after the call, refused (the old value set again) when that is over the limit. Before,
    a sync depth of 200 (1584 MiB more) was granted under 1000 MiB."""
    env = box.env(claim((0, 1000, 0)))
    o = last(memprog(box, "limit", "3", "100", str(CHUNK), env=env))  # 2 -> 100 levels: 784 MiB
    assert o["limit_rc"] == 0 and o["more"] == 2  # (1000 - 64 - 784) / 64
    o = last(memprog(box, "limit", "3", "200", str(CHUNK), env=env))  # 1584 MiB: does not fit
    assert o["limit_rc"] == 2 and o["more"] == 14
    o = last(memprog(box, "limit", "4", "100000", str(CHUNK), env=env))  # 2048 -> 100000: 383 MiB
    assert o["limit_rc"] == 0 and o["more"] == 8  # (1000 - 64 - 383) / 64
    native = last(memprog(box, "limit", "3", "200", str(CHUNK), env=box.env(shim=False)))
    assert native["limit_rc"] == 0


@pytest.mark.parametrize("how", ["data", "dataex", "fatbin", "file", "lib", "libfile"])
def test_module_globals_are_charged_and_a_load_over_the_limit_refused(box, how: str) -> None:
    """A module's __device__ variables are memory the driver takes at the load, in sizes no call
    tells (a 2 GiB one took 2048 MiB at cuModuleLoadData on an H100): a load is charged at once,
    and one that takes the container over its limit is unloaded and refused. Before, the 2048 MiB
    load was granted under 1000 MiB and 14 chunks more besides."""
    env = box.env(claim((0, 1000, 0)))
    o = last(memprog(box, "module", how, "2", "300", str(CHUNK), env=env))
    assert o["load_rc"] == [0, 0] and o["more"] == 5  # (1000 - 64 - 600) / 64
    assert o["after"] == 14  # unloaded: the charge went with them
    o = last(memprog(box, "module", how, "1", "2048", str(CHUNK), env=env))
    assert o["load_rc"] == [2] and o["more"] == 14
    native = last(memprog(box, "module", how, "1", "2048", str(CHUNK), env=box.env(shim=False)))
    assert native["load_rc"] == [0]


def test_small_module_loads_add_up_to_a_refusal(box) -> None:
    """Loads that each fit add up: the one that passes the limit is refused, and so is every
    later one."""
    o = last(memprog(box, "module", "data", "20", "60", str(CHUNK), env=box.env(claim((0, 1000, 0)))))
    assert o["load_rc"] == [0] * 15 + [2] * 5  # 64 + 15 x 60 = 964 MiB
    assert o["more"] == 0 and o["after"] == 14


@pytest.mark.parametrize("how", ["libget", "libmanaged", "libattr"])
def test_a_lazily_loaded_librarys_globals_are_charged_when_loaded(box, how: str) -> None:
    """With lazy loading a library's module reaches the context at its first use: the load takes
    nothing; cuLibraryGetGlobal, cuLibraryGetManaged or cuKernelGetAttribute (cudart's
    cudaFuncGetAttributes) takes the global and is charged at once (it cannot be undone); over
    the limit, ACTIVE_OOM_KILLER ends the process. Before the last two were hooked, their 2 x
    300 MiB went uncharged (more chunks granted than fit beside them)."""
    env = box.env(claim((0, 1000, 0)), CUDA_MODULE_LOADING="LAZY")
    o = last(memprog(box, "module", "lib", "2", "300", str(CHUNK), env=env))
    assert o["more"] == 14 and o["info_calls"] == 0  # the loads took nothing and were not watched
    o = last(memprog(box, "module", how, "2", "300", str(CHUNK), env=env))
    assert o["load_rc"] == [0, 0] and o["more"] == 5 and o["after"] == 14
    p = memprog(box, "module", how, "1", "2048", str(CHUNK), env={**env, "ACTIVE_OOM_KILLER": "true"},
                check=False)
    assert p.returncode == -signal.SIGKILL and "ACTIVE_OOM_KILLER: killing this process" in p.stderr


def test_a_kernel_attribute_on_another_card_is_asked_of_that_card(box) -> None:
    """cuKernelGetAttribute names its device: the hook hands the driver that device (a local of
    the watch once took its name, and cuBLAS's kernels then failed on an H100) and watches that
    card, not the current context's: the current card's slice is untouched."""
    env = box.env(claim((0, 1000, 0), (1, 1000, 0)), CUDA_MODULE_LOADING="LAZY", MEMPROG_ATTR_DEV="1",
                  STUB_NDEV="2")
    o = last(memprog(box, "module", "libattr", "2", "300", str(CHUNK), env=env))
    assert o["load_rc"] == [0, 0] and o["more"] == 14


def test_a_kernels_first_launch_charges_what_it_loaded(box) -> None:
    """cudart launches a lazily loaded library's kernel handle; the driver loads the module then
    (a 1 GiB __device__ array came in at the first launch on an H100, and the shim granted 512
    MiB more under 1200). A function's first launch is watched and what it took charged at once;
    later launches read nothing (2 free-memory reads per kernel, not per launch)."""
    env = box.env(claim((0, 1000, 0)), CUDA_MODULE_LOADING="LAZY")
    o = last(memprog(box, "module", "libkernel", "2", "300", str(CHUNK), env=env))
    assert o["load_rc"] == [0, 0] and o["more"] == 5 and o["after"] == 14
    assert o["info_calls"] <= 4  # 2 first launches, 100 launches after them
    p = memprog(box, "module", "libkernel", "1", "2048", str(CHUNK), env={**env, "ACTIVE_OOM_KILLER": "true"},
                check=False)
    assert p.returncode == -signal.SIGKILL and "ACTIVE_OOM_KILLER: killing this process" in p.stderr


def test_a_load_is_charged_when_a_free_hides_it(box) -> None:
    """A free racing the load (a thread frees 900 MiB while the driver reads the module's file)
    leaves the card's free memory where it was: the load is reconciled from NVML all the same,
    and the 900 MiB are not granted again on top of it. Before, both were: 1864 MiB under 1000."""
    o = last(memprog(box, "maskload", "900", env=box.env(claim((0, 1000, 0)))))
    assert o["alloc_rc"] == 0 and o["load_rc"] == 0 and o["again_rc"] == 2


@pytest.mark.parametrize("unload", ["0", "1"])
def test_a_refused_or_unloaded_module_leaves_no_charge_behind(box, unload: str) -> None:
    """A process whose 2048 MiB load was refused, or whose 600 MiB module it unloaded, then
    idles: its sibling gets the slice (13 chunks beside the two contexts). Before, the refused
    or unloaded module stayed charged to the idle process (0 or 4 chunks)."""
    env = box.env(claim((0, 1000, 0)))
    idle = subprocess.Popen([str(box.kit.stubdir / "memprog"), "loadidle", "2048" if unload == "0" else "600",
                             unload, "30"], env=env, stdout=subprocess.PIPE, text=True)
    try:
        o = json.loads(idle.stdout.readline())
        assert o["load_rc"] == (2 if unload == "0" else 0)
        assert last(memprog(box, "ctx", "0", str(CHUNK), env=env))["more"] == 13  # (1000 - 2 x 64) / 64
    finally:
        idle.kill()
        idle.wait()


def test_a_reused_library_handle_is_watched_again(box) -> None:
    """An unloaded library's handle comes back for another library (the stub reuses it): its
    first get is watched again, so a 2048 MiB global ends the process under ACTIVE_OOM_KILLER at
    that get, before its next call. Before, the handle read as watched and the process went on."""
    env = box.env(claim((0, 1000, 0)), CUDA_MODULE_LOADING="LAZY", ACTIVE_OOM_KILLER="true")
    p = memprog(box, "relib", "2048", env=env, check=False)
    assert p.returncode == -signal.SIGKILL and '"second"' not in p.stdout


def test_a_kernels_first_launch_is_watched_in_each_context(box) -> None:
    """A launch the driver refuses (no context current) does not count as the kernel's first,
    and the kernel's first launch in each card's context is watched: the 300 MiB it loads on the
    second card are charged there. Before, the refused launch marked the kernel launched (14
    chunks granted beside the 300 MiB), and so did its launch on the first card."""
    env = box.env(claim((0, 1000, 0), (1, 1000, 0)), CUDA_MODULE_LOADING="LAZY", STUB_NDEV="2")
    o = last(memprog(box, "kernels", "300", str(CHUNK), "1", env=env))
    assert o["no_context_rc"] != 0 and o["launch_rc"] == [0] and o["more"] == 9  # (1000 - 64 - 300) / 64
    o = last(memprog(box, "kernels", "300", str(CHUNK), "2", env=env))
    assert o["launch_rc"] == [0, 0] and o["more"] == 9


def test_memory_only_nvml_shows_is_charged_in_full(box) -> None:
    """800 MiB that no hook saw (device malloc, a library's workspace) take the container over
    its limit: every allocation is then refused; without ACTIVE_OOM_KILLER the process lives."""
    p = memprog(box, "hidden", "5", str(CHUNK), "800", "0", env=box.env(claim((0, 1000, 0))))
    o = last(p)
    assert p.returncode == 0 and o["alloc_rc"] == 2 and o["free"] == 0
    assert oom_kills(box)[0] == 0


def test_oom_killer_ends_the_process_over_the_limit(box) -> None:
    env = box.env(claim((0, 1000, 0)), ACTIVE_OOM_KILLER="true")
    p = memprog(box, "hidden", "5", str(CHUNK), "800", "0", env=env, check=False)
    assert p.returncode == -signal.SIGKILL
    assert "ACTIVE_OOM_KILLER: killing this process" in p.stderr
    kills, pid, nbytes = oom_kills(box)
    assert kills == 1 and pid > 0 and nbytes == (5 * 64 + 64 + 800) * MIB


def test_oom_killer_ends_the_sibling_with_the_most_memory(box) -> None:
    """B's hidden memory takes the container over; A holds the most: A is killed, B goes on."""
    holder = subprocess.Popen([str(box.kit.stubdir / "memprog"), "hidden", "10", str(CHUNK), "0", "30"],
                              env=box.env(claim((0, 1000, 0))), stdout=subprocess.PIPE, text=True)
    try:
        assert json.loads(holder.stdout.readline())["n"] == 10  # 640 + 64 MiB
        env = box.env(claim((0, 1000, 0)), ACTIVE_OOM_KILLER="1")
        p = memprog(box, "hidden", "1", str(CHUNK), "400", "0", env=env)  # 528 MiB: 1232 in all
        assert holder.wait(timeout=10) == -signal.SIGKILL
        assert f"killing PID {holder.pid}" in p.stderr
        assert last(p)["alloc_rc"] == 0  # A's memory came back
        kills, pid, _ = oom_kills(box)
        assert kills == 1 and pid == holder.pid
    finally:
        holder.kill()
        holder.wait()


def test_a_containers_later_processes_charge_the_learnt_context_size(box) -> None:
    """The first process of a container measures what its context took (NVML before and after)
    and keeps it in the region; later processes charge that before the driver makes theirs, so a
    newcomer of a container at its limit is refused without a context made and destroyed. A later
    context that takes more than learnt is still held to the limit (settled from NVML after)."""
    from kvgpu.shimcore import read_region

    env = box.env(claim((0, 1000, 0)))
    assert last(memprog(box, "ctx", "0", str(CHUNK), env=env))["more"] == 14  # (1000 - 64) / 64
    assert read_region(box.region).devices[0].context_mib == 64
    assert last(memprog(box, "ctx", "0", str(CHUNK), env=env))["more"] == 14
    bigger = last(memprog(box, "ctx", "0", str(CHUNK), env={**env, "STUB_CTX_MIB": "192"}))
    assert bigger["more"] == 12  # (1000 - 192) / 64: the 128 MiB beyond the learnt size counted
    smaller = last(memprog(box, "ctx", "0", str(CHUNK), env={**env, "STUB_CTX_MIB": "16"}))
    assert smaller["more"] == 15  # (1000 - 16) / 64: the charge settles down to what it took
