"""Issue 14 on a real kubelet: a hostile process in a sliced container forges its claim.

The pod is granted 1000 MiB. From inside its container a process exports a bigger
``KVGPU_CLAIM`` (same claim name, 100000 MiB, cores 0, priority 0), points ``KVGPU_CLAIM_FILE``
at its own file or at a sibling container's claim, or picks its own region directory; each
time ``cuprog`` (the stub driver on the simulated node reports what the shim allows) still
sees a 1000 MiB card and stops allocating at 1000 MiB. On an H200 the env forgery let a
1000 MiB grant use 3974 MiB before the fix.
"""

from __future__ import annotations

import json
import re

import pytest
from kvgpu.core import keys
from realnode.conftest import RealPods
from realnode.gpupods import claim_of, container, exec_in, gpu_pod, hami_limits

pytestmark = pytest.mark.realnode

MIB = 1 << 20
CHUNK = 64 * MIB


def _forged(claim: str) -> str:
    return re.sub(r"priority=\d", "priority=0", re.sub(r",1000,\d+", ",100000,0", claim))


def _fill(rp: RealPods, pod: str, prefix: str) -> dict:
    out = exec_in(rp, pod, "main", f"{prefix} cuprog fill alloc {CHUNK} 2>/tmp/err; cat /tmp/err >&2")
    return json.loads(next(ln for ln in out.splitlines() if ln.startswith("{")))


def _assert_granted(fill: dict) -> None:
    assert fill["total"] == 1000 * MIB, fill  # what cuMemGetInfo shows: the grant
    assert fill["rc"] == 2 and fill["bytes"] <= 1000 * MIB, fill  # OOM at the grant


def test_forged_claims_inside_the_container_get_no_more_than_the_grant(real_pods: RealPods) -> None:
    real_pods.apply(gpu_pod(real_pods, "tenant", containers=[
        container("main", hami_limits(1, 1000)), container("trainer", hami_limits(1, 3000))]))
    pod = real_pods.wait_running("tenant", timeout=120)
    claim, sibling = claim_of(pod, "main"), claim_of(pod, "trainer")
    forged = _forged(claim)
    assert forged != claim and ",100000,0" in forged

    # the container sees only its own claim, at the fixed path
    listing = exec_in(real_pods, "tenant", "main", "ls /etc/kvgpu").split()
    assert listing == ["claim"], listing
    assert exec_in(real_pods, "tenant", "main", f"cat {keys.CONTAINER_CLAIM_FILE}").strip() == claim
    assert sibling not in exec_in(real_pods, "tenant", "main", "cat /etc/kvgpu/* 2>&1")

    _assert_granted(_fill(real_pods, "tenant", ""))
    # 1. a bigger claim in the environment
    _assert_granted(_fill(real_pods, "tenant", f"KVGPU_CLAIM='{forged}'"))
    # 2. the claim file pointed at the process's own file
    exec_in(real_pods, "tenant", "main", f"printf %s '{forged}' >/tmp/forged")
    _assert_granted(_fill(real_pods, "tenant", f"KVGPU_CLAIM_FILE=/tmp/forged KVGPU_CLAIM='{forged}'"))
    # 3. the sibling container's (bigger) claim, as the old shared volume offered it
    exec_in(real_pods, "tenant", "main", f"printf %s '{sibling}' >/tmp/sibling")
    _assert_granted(_fill(real_pods, "tenant", f"KVGPU_CLAIM_FILE=/tmp/sibling KVGPU_CLAIM='{sibling}'"))
    # 4. a region of its own (a second quota) while another process holds 512 MiB
    out = exec_in(real_pods, "tenant", "main",
                  f"cuprog fill alloc {512 * MIB} 1 6 >/tmp/holder.json & sleep 2; "
                  f"mkdir -p /tmp/r; KVGPU_REGION_DIR=/tmp/r cuprog fill alloc {CHUNK}; wait")
    fill = json.loads(next(ln for ln in out.splitlines() if ln.startswith("{")))
    assert fill["rc"] == 2 and fill["bytes"] <= 1000 * MIB - 512 * MIB, fill  # one quota
    assert "vgpu.region" not in exec_in(real_pods, "tenant", "main", "ls /tmp/r")
