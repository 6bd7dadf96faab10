"""The region boundary from the agent's side, on a real kubelet: a tenant owns its region file
(the directory is mounted read-write into its container), and the node agent reads every region
ten times a second for the compute schedule. A tenant that truncates its region in a loop, then
puts a FIFO in its place, must neither kill the agent (a mapped read of a truncated file is
SIGBUS) nor stall it (a plain open of a FIFO blocks): afterwards the agent still runs and still
lays out a neighbour that starts launching.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from kvgpu.agent.schedule import decode
from kvgpu.core import keys
from kvgpu.shimregion import REGION_SIZE
from realnode.conftest import RealPods
from realnode.gpupods import claim_of, container, exec_in, gpu_pod, hami_limits, uuids_of, wait_for

pytestmark = pytest.mark.realnode

REGION = "/var/run/kvgpu/vgpu.region"
SHRINK = f"""
import os, time
fd, end = os.open("{REGION}", os.O_RDWR), time.monotonic() + 8
while time.monotonic() < end:
    os.ftruncate(fd, 0)
    os.ftruncate(fd, {REGION_SIZE})
"""


def listed(card: str, name: str) -> bool:
    try:
        return any(w.key == name for w in decode((Path(keys.HOST_SCHED_DIR) / f"{card}.sched").read_bytes()))
    except (OSError, ValueError):
        return False


def test_a_tenant_that_truncates_or_replaces_its_region_stops_no_agent(real_pods: RealPods) -> None:
    real_pods.apply(gpu_pod(real_pods, "saboteur", containers=[container("main", hami_limits(1, 1000, 30))]))
    pod = real_pods.wait_running("saboteur", timeout=120)
    (card,) = uuids_of(pod, "main")
    mine = claim_of(pod, "main").split("claim=", 1)[1].split(";", 1)[0]
    exec_in(real_pods, "saboteur", "main", "cuprog launch kernel 6 20 </dev/null >/dev/null 2>&1 &")
    wait_for(lambda: listed(card, mine), 10, f"the agent's schedule of {card} listing {mine}")

    # the attack: shrink and regrow the region for 8 s while the agent reads it, then a FIFO
    exec_in(real_pods, "saboteur", "main", f"python3 -c '{SHRINK}'")
    out = exec_in(real_pods, "saboteur", "main", f"rm -f {REGION} && mkfifo {REGION} && ls -l {REGION}")
    assert out.startswith("p"), out
    agent = real_pods.node.agent
    assert agent is not None and agent.poll() is None, "the agent died"

    # the agent still works: a neighbour on the same card that starts launching is laid out
    real_pods.apply(gpu_pod(real_pods, "neighbour", containers=[container("main", hami_limits(1, 1000, 30))]))
    other = real_pods.wait_running("neighbour", timeout=120)
    (other_card,) = uuids_of(other, "main")
    name = claim_of(other, "main").split("claim=", 1)[1].split(";", 1)[0]
    exec_in(real_pods, "neighbour", "main", "cuprog launch kernel 6 20 </dev/null >/dev/null 2>&1 &")
    wait_for(lambda: listed(other_card, name), 15, f"the agent's schedule of {other_card} listing {name}")
    assert agent.poll() is None, "the agent died"
