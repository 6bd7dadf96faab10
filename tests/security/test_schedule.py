"""Issue 14, "Shared compute schedule", on a real kubelet: a sliced container cannot write the
node-wide compute schedule.

Before, every sliced container mounted ``/var/run/kvgpu-sched`` read-write and the card's
``<UUID>.sched`` (mode 0666) held a process-shared mutex every co-tenant took, so a hostile
tenant could stall its neighbours' launches, rewrite shares or make itself priority 0. Now the
directory is mounted read-only and the node agent alone writes the files (root's, 0644); the
tenant's activity goes into its own region. From inside the pod a write fails, and the claim
still works: the memory grant holds, launches run, and the agent lists the pod's window.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from kvgpu.agent.schedule import decode
from kvgpu.core import keys
from realnode.conftest import RealPods
from realnode.gpupods import claim_of, container, exec_in, gpu_pod, hami_limits, uuids_of, wait_for

pytestmark = pytest.mark.realnode

MIB = 1 << 20


def test_a_tenant_cannot_write_the_compute_schedule(real_pods: RealPods) -> None:
    real_pods.apply(gpu_pod(real_pods, "sched", containers=[container("main", hami_limits(1, 1000, 30))]))
    pod = real_pods.wait_running("sched", timeout=120)
    claim = claim_of(pod, "main")
    (card,) = uuids_of(pod, "main")
    name = claim.split("claim=", 1)[1].split(";", 1)[0]
    sched = keys.CONTAINER_SCHED_DIR

    # launches run, so the shim stamps its region and the agent lays out the card
    exec_in(real_pods, "sched", "main", "cuprog launch kernel 6 20 </dev/null >/tmp/launch.json 2>/tmp/launch.err &")
    host_file = Path(keys.HOST_SCHED_DIR) / f"{card}.sched"

    def listed() -> bool:
        try:
            return any(w.key == name for w in decode(host_file.read_bytes()))
        except (OSError, ValueError):
            return False

    wait_for(listed, 10, f"the agent's schedule of {card} listing {name}")
    st = host_file.stat()
    assert st.st_uid == 0 and st.st_mode & 0o777 == 0o644, oct(st.st_mode)
    before = host_file.read_bytes()

    # every way of writing the schedule from inside the container fails
    out = exec_in(real_pods, "sched", "main",
                  f"echo x > {sched}/{card}.sched; echo rc=$?; "
                  f"touch {sched}/planted; echo rc=$?; "
                  f"rm -f {sched}/{card}.sched; echo rc=$?; "
                  f"mv {sched}/{card}.sched {sched}/x 2>&1; echo rc=$?; "
                  f"grep ' {sched} ' /proc/mounts", check=False)
    rcs = [ln for ln in out.splitlines() if ln.startswith("rc=")]
    assert len(rcs) == 4 and "rc=0" not in rcs, out
    assert "Read-only file system" in out, out
    mount = next(ln for ln in out.splitlines() if f" {sched} " in ln)
    assert " ro," in mount or " ro " in mount, mount
    assert not (Path(keys.HOST_SCHED_DIR) / "planted").exists()
    assert host_file.read_bytes() == before or listed()

    # the claim still works: the launches ran, the memory grant holds
    time.sleep(6.5)
    launch = json.loads(next(ln for ln in exec_in(real_pods, "sched", "main", "cat /tmp/launch.json").splitlines()
                             if ln.startswith("{")))
    assert launch.get("rate", 0) > 0, launch
    fill = exec_in(real_pods, "sched", "main", f"cuprog fill alloc {64 * MIB}")
    got = json.loads(next(ln for ln in fill.splitlines() if ln.startswith("{")))
    assert got["total"] == 1000 * MIB and got["rc"] == 2 and got["bytes"] <= 1000 * MIB, got
