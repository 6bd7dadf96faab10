#!/usr/bin/env python3
"""GPU check: kvgpu's NVML discovery must agree with nvidia-smi.

Needs only nvidia-ml-py (``pynvml``) and ``nvidia-smi`` on PATH; run from the repository root::

    python3 bench/gpu/discovery_check.py [--node NAME] [--json OUT]
    python3 bench/gpu/discovery_check.py --compare-q OUT.json h200-nvidia-smi.txt   # offline

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


def parse_smi_q(text: str) -> list[dict[str, str]]:
    """Cards from ``nvidia-smi -q`` text: uuid, name, memory (FB total MiB), minor, mig."""
    cards: list[dict[str, str]] = []
    section = ""
    for raw in text.splitlines():
        line = raw.rstrip()
        if line.startswith("GPU ") and ":" in line and not line.startswith("GPU UUID"):
            cards.append({"bus": line.split(None, 1)[1]})
            section = ""
            continue
        if not cards or not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        key, sep, value = line.strip().partition(":")
        key, value = key.strip(), value.strip()
        if not sep or (not value and indent <= 4):
            section = key
            continue
        if indent <= 4:
            section = ""
        c = cards[-1]
        if key == "GPU UUID":
            c["uuid"] = value
        elif key == "Product Name":
            c["name"] = value
        elif key == "Minor Number":
            c["minor"] = value
        elif section == "FB Memory Usage" and key == "Total":
            c["memory"] = value.split()[0]
        elif section == "MIG Mode" and key == "Current":
            c["mig"] = value
    return cards


def compare_offline(inventory_json: str, smi_q: str) -> int:
    """Compare a saved inventory (``--json`` output) with saved ``nvidia-smi -q`` text."""
    inv = json.loads(pathlib.Path(inventory_json).read_text())
    q = {c.get("uuid"): c for c in parse_smi_q(pathlib.Path(smi_q).read_text())}
    bad = 0
    for c in inv["cards"]:
        r = q.get(c["uuid"])
        if r is None:
            print(f"MISMATCH {c['uuid']}: not in {smi_q}")
            bad += 1
            continue
        for what, ours, theirs in (
            ("model", c["model"], r.get("name")),
            ("memoryMiB", str(c["memoryMiB"]), r.get("memory")),
            ("migMode", "Enabled" if c["migMode"] else "Disabled", r.get("mig", "Disabled")),
        ):
            ok = ours == theirs or (
                what == "migMode" and r.get("mig") in (None, "N/A") and ours == "Disabled"
            )
            bad += not ok
            print(
                f"{'ok      ' if ok else 'MISMATCH'} {c['uuid']} {what}: kvgpu={ours} nvidia-smi -q={theirs}"
            )
        print(f"info     {c['uuid']} smCount={c['smCount']} (nvidia-smi -q prints no SM count)")
    if len(q) != len(inv["cards"]):
        print(f"MISMATCH card count: inventory {len(inv['cards'])}, nvidia-smi -q {len(q)}")
        bad += 1
    print("RESULT:", "PASS" if not bad else f"FAIL ({bad} mismatches)")
    return 1 if bad else 0


def health_check(d: NvmlDiscovery, uuids: list[str]) -> int:
    """The health source's probe must pass on a healthy card, and XID events must register."""
    from kvgpu.agent.health import NvmlHealthSource

    src = NvmlHealthSource(lambda: uuids, nvml=d.nvml)
    bad = 0
    for u in uuids:
        o = src.probe(u)
        bad += not o.ok
        print(f"{'ok      ' if o.ok else 'MISMATCH'} {u} health probe: {o.reason or 'healthy'}")
    from kvgpu.agent.enforcement import ProcessUtilization, attribute, nvml_processes

    procs = nvml_processes(d.nvml, uuids)
    util = ProcessUtilization(d.nvml)(uuids)
    for p in procs:
        print(
            f"info     {p.uuid} process host_pid={p.host_pid} used={p.used_bytes >> 20}MiB "
            f"sm={util.get((p.uuid, p.host_pid), 'n/a')} attribution={attribute(p.host_pid)}"
        )
    print(f"info     NVML compute processes: {len(procs)}; utilisation samples: {len(util)}")
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
    ap.add_argument(
        "--compare-q",
        nargs=2,
        metavar=("INVENTORY_JSON", "SMI_Q_TXT"),
        help="offline: compare a saved inventory with saved `nvidia-smi -q` output",
    )
    a = ap.parse_args()
    if a.compare_q:
        return compare_offline(*a.compare_q)
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
