"""The oversubscription contract (memoryScaling > 1: co-tenants' limits sum past the card), on
the stub card (4096 MiB physical, shared by every process of a test through STUB_STATE): each
limit is a ceiling; once the card is physically full an allocation fails with the driver's own
CUDA_ERROR_OUT_OF_MEMORY below the limit, the shim rolls its charge back (the tenant may allocate
again when memory frees), the tenant never gets another's memory, nothing crashes, and free
memory (cuMemGetInfo, NVML) reads min(limit left, physical free).

Two tenants are two containers: their own claim and their own shim region directory."""

from __future__ import annotations

import json
import subprocess
import sys

from .conftest import MIB, claim
from .test_memory import NVML_PROBE

CHUNK = 64 * MIB
CTX = 64  # STUB_CTX_MIB in the box


def _tenant(box, name: str, limit: int) -> dict[str, str]:
    region = box.dir / f"region-{name}"
    region.mkdir(exist_ok=True)
    return box.env(claim((0, limit, 0), name=f"{name}/job"), KVGPU_REGION_DIR=str(region))


def test_tenants_over_physical_memory_get_the_drivers_oom_inside_their_limit(box) -> None:
    a, b = _tenant(box, "team-a", 3000), _tenant(box, "team-b", 3000)  # 6000 MiB promised on 4096
    holder = subprocess.Popen([str(box.kit.cuprog), "fill", "alloc", str(CHUNK), "40", "30"], env=a,
                              stdout=subprocess.PIPE, text=True)
    try:
        first = json.loads(holder.stdout.readline())
        assert first["n"] == 40 and first["rc"] == 0  # A holds 40 x 64 + its context = 2624 MiB
        physical_free = 4096 - 40 * 64 - CTX

        # B sees the truth before it allocates: free = min(limit left, physical free)
        info = box.json("info", env=b)[0]
        assert info["rc"] == 0 and info["total"] == 3000 * MIB
        assert info["free"] == (physical_free - CTX) * MIB < (3000 - CTX) * MIB

        # cuMemGetInfo and NVML: sliced totals, free bounded by what that API says is physically
        # free (NVML's _v2 keeps the driver's reserved memory out of free: 5 MiB on the stub)
        o = json.loads(box.run(sys.executable, "-c", NVML_PROBE, "512", env=b).stdout)
        want_free = (physical_free - CTX - 512) * MIB
        assert o["cu_free"] == o["v1"][2] == want_free, o
        assert o["v2"][2] == want_free - 5 * MIB, o
        assert o["v1"][0] == 3000 * MIB and o["v1"][1] == (512 + CTX) * MIB

        # B fills: the driver's OOM (2) below its limit, after exactly the physical room
        out = box.json("fill", "alloc", str(CHUNK), env=b)
        got = out[0]
        assert got["rc"] == 2, got
        assert got["n"] == (physical_free - CTX) // 64 and got["bytes"] < (3000 - CTX) * MIB
        assert got["free"] == 0  # nothing left on the card, though B's limit has room
        assert out[1]["freed"] == got["n"]  # the process went on and freed cleanly: no crash

        # A kept every byte: it is alive, still holding, and frees its 40 chunks at the end
        assert holder.poll() is None
        # B's refused charge was rolled back: with A's memory still held, B gets the same room again
        again = box.json("fill", "alloc", str(CHUNK), env=b)[0]
        assert (again["n"], again["rc"]) == (got["n"], 2)
    finally:
        holder.terminate()
        holder.wait(timeout=30)


def test_limit_still_binds_when_the_card_has_room(box) -> None:
    """The other half of the contract: with physical memory to spare, the tenant's own limit
    is what stops it (the shim's OOM at the limit, not the driver's)."""
    a = _tenant(box, "team-a", 1000)
    b = _tenant(box, "team-b", 3000)
    got = box.json("fill", "alloc", str(CHUNK), env=a)[0]
    assert got["rc"] == 2 and got["n"] == (1000 - CTX) // 64
    got = box.json("fill", "alloc", str(CHUNK), env=b)[0]
    assert got["rc"] == 2 and got["n"] == (3000 - CTX) // 64
