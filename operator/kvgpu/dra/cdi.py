"""The CDI spec of one prepared ResourceClaim (Container Device Interface, spec version
:data:`CDI_VERSION`), as containerd's CDI support reads it from its ``cdi_spec_dirs``. Pure: the
kubelet plugin (:mod:`kvgpu.agent.draplugin`) gathers the edits and writes the file.

One spec file ``<cdi dir>/gpu.kvgpu.io-<claim UID>.json`` per claim, kind :data:`CDI_KIND`::

    {"cdiVersion": "0.6.0", "kind": "gpu.kvgpu.io/claim",
     "containerEdits": {env, deviceNodes (control nodes), mounts (shim, ld.so.preload,
                        the claim file, the claim's region, the schedule, the driver)},
     "devices": [{"name": "<claim UID>-gpu-0",
                  "containerEdits": {"deviceNodes": [/dev/nvidia<minor>]}}, ...]}

The spec-wide edits are applied once per container whatever number of the claim's devices it
gets; each device adds its card's node. CDI device IDs: ``gpu.kvgpu.io/claim=<claim UID>-<device>``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .slices import DRIVER

CDI_VERSION = "0.6.0"
CDI_CLASS = "claim"
CDI_KIND = f"{DRIVER}/{CDI_CLASS}"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]*$")


@dataclass(frozen=True, slots=True)
class DeviceNode:
    """A device node: ``host_path`` on the host, ``path`` in the container, ``rw`` permissions."""

    path: str
    host_path: str


@dataclass(frozen=True, slots=True)
class Mount:
    """A bind mount of ``host_path`` on ``container_path``; ``read_only`` unless told otherwise."""

    host_path: str
    container_path: str
    read_only: bool = True


def spec_file_name(claim_uid: str) -> str:
    """The spec's file name in the CDI directory (``gpu.kvgpu.io-<UID>.json``). Raises
    ``ValueError`` for a UID that is not a CDI name."""
    _check_name(claim_uid)
    return f"{DRIVER}-{claim_uid}.json"


def device_id(claim_uid: str, device: str) -> str:
    """The fully qualified CDI device ID of ``device`` of the claim."""
    return f"{CDI_KIND}={cdi_device_name(claim_uid, device)}"


def cdi_device_name(claim_uid: str, device: str) -> str:
    name = f"{claim_uid}-{device}"
    _check_name(name)
    return name


def _check_name(name: str) -> None:
    if not _NAME.match(name):
        raise ValueError(f"{name!r} is not a CDI device name (letters, digits, _ . : -)")


def _node(n: DeviceNode) -> dict[str, Any]:
    return {"path": n.path, "hostPath": n.host_path, "permissions": "rw"}


def _mount(m: Mount) -> dict[str, Any]:
    opts = ["ro" if m.read_only else "rw", "nosuid", "nodev", "rbind"]
    return {"hostPath": m.host_path, "containerPath": m.container_path, "options": opts}


def claim_spec(
    claim_uid: str,
    devices: Mapping[str, Sequence[DeviceNode]],
    shared_nodes: Sequence[DeviceNode],
    mounts: Sequence[Mount],
    env: Mapping[str, str],
) -> dict[str, Any]:
    """The CDI spec of one claim: ``devices`` = the card nodes by device name (``gpu-0``), the
    rest is spec-wide (module docstring). Raises ``ValueError`` for a claim without devices or
    a name CDI refuses."""
    if not devices:
        raise ValueError(f"claim {claim_uid}: a CDI spec needs at least one device")
    return {
        "cdiVersion": CDI_VERSION,
        "kind": CDI_KIND,
        "containerEdits": {
            "env": [f"{k}={v}" for k, v in sorted(env.items())],
            "deviceNodes": [_node(n) for n in shared_nodes],
            "mounts": [_mount(m) for m in mounts],
        },
        "devices": [
            {"name": cdi_device_name(claim_uid, name), "containerEdits": {"deviceNodes": [_node(n) for n in nodes]}}
            for name, nodes in devices.items()
        ],
    }
