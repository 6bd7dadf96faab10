"""The seed walk-through, control-plane half: on the real local control plane, with kvgpu
running, create the seed's pod (examples/pod-annotations.yaml: 1 card, 3000 MiB, 30 %) on a fake
node whose inventory is the H200 recorded in bench/gpu/h200-nvidia-smi.txt, and write what the
downward API would give its container into bench/gpu/seed-claim.env (KVGPU_CLAIM,
NVIDIA_VISIBLE_DEVICES) plus the cluster's view into bench/gpu/seed-cluster.txt.

    .venv/bin/python bench/gpu/seed_claim.py

The GPU half is bench/gpu/seed.sh, run on the H200 machine.
"""

from __future__ import annotations

import asyncio
import json
import re
import shlex
import sys
import tempfile
import time
from pathlib import Path

from kvgpu.core import keys
from kvgpu.core.inventory import Card, NodeInventory, SimulatedNode
from kvgpu.devcluster import Cluster
from kvgpu.devcluster.fakenodes import node_manifest
from kvgpu.devcluster.system import KvgpuSystem

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent


def h200_inventory(node: str) -> NodeInventory:
    text = (HERE / "h200-nvidia-smi.txt").read_text()
    m = re.search(r"^(GPU-[0-9a-f-]+), (\d+), ([^,]+), (\d+) MiB", text, re.M)
    if not m:
        sys.exit("bench/gpu/h200-nvidia-smi.txt has no uuid,index,name,memory line")
    uuid, index, name, mem = m.group(1), int(m.group(2)), m.group(3).strip(), int(m.group(4))
    card = Card(uuid=uuid, index=index, model=name, memory_mib=mem, sm_count=132, numa=0)
    return NodeInventory(node, (card,), "nvml", "580.159.04", "13.0")


def main() -> None:
    run = Path(tempfile.mkdtemp(prefix="kvgpu-seed-"))
    c = Cluster(run_dir=run)
    system = KvgpuSystem(c)
    try:
        c.start()
        system.start()
        inv = h200_inventory("h200-node")
        body = node_manifest(SimulatedNode("h200-node"), split_count=10)
        body["metadata"]["annotations"][keys.NODE_INVENTORY] = inv.dumps()
        body["status"]["capacity"]["nvidia.com/gpu"] = body["status"]["allocatable"]["nvidia.com/gpu"] = "10"

        async def mk() -> None:
            from kubernetes_asyncio import client

            async with c.api() as api:
                await client.CoreV1Api(api).create_node(body)

        asyncio.run(mk())
        c.kubectl("apply", "-f", str(ROOT / "examples" / "pool.yaml"))
        time.sleep(1.0)
        c.kubectl("apply", "-f", str(ROOT / "examples" / "pod-annotations.yaml"))
        for _ in range(150):
            pod = json.loads(c.kubectl("get", "pod", "cuda-slice", "-o", "json").stdout)
            if pod["spec"].get("nodeName"):
                break
            time.sleep(0.2)
        else:
            sys.exit("the seed pod was not bound: " + c.kubectl("get", "events").stdout)
        ann = pod["metadata"]["annotations"]
        claim = ann[keys.claim_annotation("cuda")]
        devices = ann[keys.devices_annotation("cuda")]
        # Shell syntax (the claim contains ';'): `set -a; . seed-claim.env` exports both.
        (HERE / "seed-claim.env").write_text(
            f"KVGPU_CLAIM={shlex.quote(claim)}\nNVIDIA_VISIBLE_DEVICES={shlex.quote(devices)}\n")
        view = [
            "$ kubectl get pod cuda-slice -o wide", c.kubectl("get", "pod", "cuda-slice", "-o", "wide").stdout,
            "$ kubectl get vgpuclaims -o wide", c.kubectl("get", "vgpuclaims", "-o", "wide").stdout,
            "$ kubectl get pod cuda-slice -o jsonpath='{.spec.containers[0].env}'",
            json.dumps(pod["spec"]["containers"][0].get("env"), indent=1),
        ]
        (HERE / "seed-cluster.txt").write_text("\n".join(view) + "\n")
        print("\n".join(view))
        print(f"wrote {HERE / 'seed-claim.env'}")
    finally:
        system.stop()
        c.stop()


if __name__ == "__main__":
    main()
