"""fork and threads through the shim, on the stub card (4096 MiB, 64 MiB context, 2 MiB pages).

PyTorch DataLoader workers are forked from a parent that holds a CUDA context while its other
threads keep launching and allocating; a lock of the shim held by one of those threads at the
moment of fork would hang the child for ever (it has only the forking thread). ``cuprog fork``
forks children while busy threads take every lock of the shim (allocation table, region slot,
compute gate, NVML view); a child stuck for 10 s dies of SIGALRM and is counted. ``cuprog
threads`` allocates from many threads at once: every charge must be counted exactly once.
"""

from __future__ import annotations

import pytest

from .conftest import MIB, claim

CLAIM = claim((0, 2000, 50))  # a memory limit and a compute gate: every lock is in use


@pytest.mark.parametrize("kind", ["idle", "cuda", "exec"])
def test_fork_from_a_busy_parent_never_hangs_the_child(box, kind: str) -> None:
    env = box.env(CLAIM, STUB_KERNEL_US=20, CUPROG_EXEC_CHUNK=2 * MIB)
    out = box.json("fork", kind, "40", "4", env=env, timeout=120)
    res = out[-1]
    assert res["kind"] == kind and res["children"] == 40
    assert res["stuck"] == 0, res  # a lock held across fork: the child hangs
    assert res["ok"] == 40 and res["failed"] == 0 and res["keep_rc"] == 0
    # the parent's own charge is right after all its children came and went: its 8 MiB are
    # freed, the context stays, nothing of the children is left behind
    assert res["total"] == 2000 * MIB and res["free"] == (2000 - 64) * MIB
    if kind == "exec":
        fills = [o for o in out if "n" in o]
        assert len(fills) == 40 and all(f["n"] == 4 and f["rc"] == 0 for f in fills)
        # each exec'd program is a process of the container with its own context and slot
        assert all(f["total"] == 2000 * MIB for f in fills)


@pytest.mark.parametrize("threads", [1, 8, 32])
def test_concurrent_allocations_are_charged_exactly_once(box, threads: int) -> None:
    n = 12
    chunk = 2 * MIB  # the stub's page: NVML shows exactly what was charged, no rounding
    res = box.json("threads", str(threads), str(n), str(chunk), env=box.env(CLAIM, STUB_KERNEL_US=5))[0]
    assert res["allocated"] == threads * n  # 32 x 12 x 2 MiB fit in 2000 MiB
    assert res["held"] == threads * n * chunk, res  # nothing lost, nothing counted twice
    assert res["after"] == 0, res


def test_concurrent_allocations_stop_at_the_limit(box) -> None:
    """Many threads racing to the limit together never overshoot it."""
    chunk = 64 * MIB
    # 16 threads x 4 x 64 MiB = 4096 MiB asked of 1000 MiB - 64 MiB context: 14 chunks fit
    res = box.json("threads", "16", "4", str(chunk), env=box.env(claim((0, 1000, 0))))[0]
    assert res["allocated"] == 14, res
    assert res["held"] == 14 * chunk and res["after"] == 0
