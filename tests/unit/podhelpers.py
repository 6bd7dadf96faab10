"""Pod API dicts for the device plugin's identification tests."""

from __future__ import annotations

from kvgpu.core import keys

GPU = "nvidia.com/gpu"


def ctr(name, gpus=0):
    c = {"name": name, "image": "x"}
    if gpus:
        c["resources"] = {"limits": {GPU: str(gpus)}}
    return c


def pod(name, containers, *, init=(), claims=None, ns="default", node="gpu-0", created="2026-12-01T10:00:00Z",
        phase="Pending", uid=None):
    """``claims``: ``{container: [card UUIDs]}`` written as the operator's annotations."""
    ann = {}
    for c, uuids in (claims or {}).items():
        devs = ";".join(f"dev={u},3000,30" for u in uuids)
        ann[keys.claim_annotation(c)] = f"v1;claim={ns}/{name}-{c};priority=1;{devs}"
        ann[keys.devices_annotation(c)] = ",".join(uuids)
    return {
        "metadata": {"name": name, "namespace": ns, "uid": uid or f"uid-{name}", "annotations": ann,
                     "creationTimestamp": created},
        "spec": {"nodeName": node, "initContainers": list(init), "containers": list(containers)},
        "status": {"phase": phase},
    }
