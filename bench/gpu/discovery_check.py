#!/usr/bin/env python3
"""GPU check: kvgpu's NVML discovery must agree with nvidia-smi.

Needs only nvidia-ml-py (``pynvml``) and ``nvidia-smi`` on PATH; run from the repository root::

    python3 bench/gpu/discovery_check.py [--node NAME] [--json OUT]

Prints the inventory JSON (the ``kvgpu.io/inventory`` annotation the agent would publish), then
per card the comparison with
``nvidia-smi --query-gpu=uuid,index,name,memory.total --format=csv,noheader,nounits``
(UUID, index, model, memory MiB) and the SM count with where it came from (NVML attributes, the
CUDA driver attribute, or the model table; NVML and CUDA are cross-checked when both answer).
Exit status: 0 all equal, 1 a mismatch, 2 could not run (no NVML / nvidia-smi).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import socket
import subprocess
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "operator"))

from kvgpu.agent.discovery import DiscoveryError, NvmlDiscovery, cuda_sm_counts


def smi_cards() -> list[dict[str, str]]:
    out = subprocess.run(
        [
            "nvidia-smi",
            "--query-gpu=uuid,index,name,memory.total",
            "--format=csv,noheader,nounits",
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    rows = []
    for line in out.strip().splitlines():
        uuid, index, name, mem = (x.strip() for x in line.split(","))
        rows.append({"uuid": uuid, "index": index, "name": name, "memory": mem})
    return rows


def health_check(d: NvmlDiscovery, uuids: list[str]) -> int:
    """The health source's probe must pass on a healthy card, and XID events must register."""
    from kvgpu.agent.health import NvmlHealthSource

    src = NvmlHealthSource(lambda: uuids, nvml=d.nvml)
    bad = 0
    for u in uuids:
        o = src.probe(u)
        bad += not o.ok
        print(f"{'ok      ' if o.ok else 'MISMATCH'} {u} health probe: {o.reason or 'healthy'}")
    nv = d.nvml
    es = nv.nvmlEventSetCreate()
    try:
        for u in uuids:
            h = nv.nvmlDeviceGetHandleByUUID(u)
            supported = nv.nvmlDeviceGetSupportedEventTypes(h)
            xid = bool(supported & nv.nvmlEventTypeXidCriticalError)
            try:
                nv.nvmlDeviceRegisterEvents(h, supported & nv.nvmlEventTypeXidCriticalError, es)
                reg = "registered"
            except Exception as e:
                reg = f"not registered ({e})"
            print(f"info     {u} XID events supported={xid} {reg} (mask 0x{supported:x})")
    finally:
        nv.nvmlEventSetFree(es)
    return bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--node", default=socket.gethostname())
    ap.add_argument("--json", help="also write the inventory JSON here")
    a = ap.parse_args()
    d = NvmlDiscovery(a.node)
    try:
        inv = d.discover()
    except DiscoveryError as e:
        print(f"discovery failed: {e}", file=sys.stderr)
        return 2
    text = json.dumps(inv.to_json(), indent=2, sort_keys=True)
    print(text)
    if a.json:
        pathlib.Path(a.json).write_text(text + "\n")
    try:
        smi = {r["uuid"]: r for r in smi_cards()}
    except (OSError, subprocess.CalledProcessError) as e:
        print(f"nvidia-smi failed: {e}", file=sys.stderr)
        return 2
    cuda = cuda_sm_counts()
    bad = 0
    if len(smi) != len(inv.cards):
        print(f"MISMATCH card count: nvml {len(inv.cards)} nvidia-smi {len(smi)}")
        bad += 1
    details = {x.uuid: x for x in d.details}
    for c in inv.cards:
        r = smi.get(c.uuid)
        if r is None:
            print(f"MISMATCH {c.uuid}: not listed by nvidia-smi")
            bad += 1
            continue
        checks = [
            ("index", str(c.index), r["index"]),
            ("model", c.model, r["name"]),
            ("memoryMiB", str(c.memory_mib), r["memory"]),
        ]
        det = details[c.uuid]
        if c.uuid in cuda and det.sm_source == "nvml":
            checks.append(("smCount nvml vs cuda", str(c.sm_count), str(cuda[c.uuid])))
        for what, ours, theirs in checks:
            ok = ours == theirs
            bad += not ok
            print(
                f"{'ok      ' if ok else 'MISMATCH'} {c.uuid} {what}: kvgpu={ours} nvidia-smi/cuda={theirs}"
            )
        ok_sm = c.sm_count > 0
        bad += not ok_sm
        print(
            f"{'ok      ' if ok_sm else 'MISMATCH'} {c.uuid} smCount={c.sm_count} (source {det.sm_source}; "
            f"cuda says {cuda.get(c.uuid, 'n/a')}) numa={c.numa} mig={c.mig_mode} "
            f"bus={det.pci_bus_id} totalBytes={det.memory_total_bytes}"
        )
    bad += health_check(d, [c.uuid for c in inv.cards])
    d.shutdown()
    print("RESULT:", "PASS" if not bad else f"FAIL ({bad} mismatches)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
