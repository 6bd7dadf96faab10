"""Names shared by every component: API group, annotation keys, env vars, host paths.

The allocation annotations are per container. A container name may be 63 characters and an
annotation name part may be 63 too, so :func:`container_key` hashes names that do not fit.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

GROUP = "kvgpu.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

SCHEDULER_NAME = "kvgpu-scheduler"
FIELD_MANAGER = "kvgpu-operator"
OPERATOR_USERNAME_ENV = "KVGPU_OPERATOR_USERNAME"

# Node annotations.
NODE_INVENTORY = f"{GROUP}/inventory"  # written by the agent (JSON, see core.inventory)
NODE_ALLOCATION = f"{GROUP}/allocation"  # written by earlier operators (a usage summary); now removed
NODE_LABEL_GPU = f"{GROUP}/gpu-node"  # "true" on nodes that run the agent
#: written by the agent: the installed shim and whether it loads (JSON, see agent.shimcheck)
NODE_SHIM = f"{GROUP}/shim"

# Pod annotations written by the operator at bind time (users may not set or change them).
POD_NODE = f"{GROUP}/bound-node"
POD_CLAIMS = f"{GROUP}/claims"  # comma list of VGPUClaim names of the pod
POD_REQUEUE = f"{GROUP}/requeue"  # touched by the operator to retry a pending pod at once
POD_MANAGED_LABEL = f"{GROUP}/managed"  # label "true" set by the mutating webhook
#: Set by the mutating webhook on every pod it admits: the comma list of the containers it gave
#: slices (empty: none); the pod policy (kvgpu.admission.podpolicy) checks the stored pod by it.
POD_ADMITTED = f"{GROUP}/admitted"
NOT_ADMITTED = (f"the pod asks GPU slices but was not admitted by kvgpu's webhook (no {POD_MANAGED_LABEL} label; "
                "its namespace is excluded, e.g. kube-system?): it would run without the shim and its env, "
                "so kvgpu gives it no slice; create it in a namespace the webhook serves")


def webhook_admitted(pod: Mapping[str, Any]) -> bool:
    """Whether kvgpu's mutating webhook prepared ``pod`` (it labels every pod it gives slices)."""
    labels = ((pod.get("metadata") or {}).get("labels")) or {}
    return labels.get(POD_MANAGED_LABEL) == "true"
CLAIM_PREFIX = f"{GROUP}/claim."  # + container key: the KVGPU_CLAIM string
DEVICES_PREFIX = f"{GROUP}/devices."  # + container key: comma list of card UUIDs
ALLOCATION_ANNOTATION_PREFIXES = (CLAIM_PREFIX, DEVICES_PREFIX)
ALLOCATION_ANNOTATIONS = (POD_NODE, POD_CLAIMS, POD_REQUEUE)

# Env vars the shim reads (and that users may not set themselves).
ENV_CLAIM = "KVGPU_CLAIM"
ENV_CLAIM_FILE = "KVGPU_CLAIM_FILE"
ENV_REGION_DIR = "KVGPU_REGION_DIR"
ENV_POD_UID = "KVGPU_POD_UID"
ENV_SCHED_DIR = "KVGPU_SCHED_DIR"  # node-wide compute schedule files, one per card (co-tenants)
ENV_VISIBLE = "NVIDIA_VISIBLE_DEVICES"
RESERVED_ENV = (
    ENV_CLAIM,
    ENV_CLAIM_FILE,
    ENV_REGION_DIR,
    ENV_POD_UID,
    ENV_SCHED_DIR,
    ENV_VISIBLE,
    "LD_PRELOAD",
    "CUDA_DEVICE_MEMORY_LIMIT",
    "CUDA_DEVICE_SM_LIMIT",
    "CUDA_DEVICE_MEMORY_SHARED_CACHE",
    "CUDA_DISABLE_CONTROL",
)

# Paths on the host (agent installs) and in the container (webhook mounts).
HOST_SHIM_DIR = "/usr/local/kvgpu/lib"
HOST_PRELOAD_FILE = "/usr/local/kvgpu/ld.so.preload"
HOST_REGION_ROOT = "/var/lib/kvgpu/containers"
HOST_SCHED_DIR = "/var/lib/kvgpu/sched"
#: The MPS backend: per card ``<root>/<UUID>/{pipe,log}`` of its control daemon (agent/mps.py).
HOST_MPS_ROOT = "/var/run/kvgpu/mps"
CONTAINER_SHIM_DIR = "/usr/local/kvgpu/lib"
CONTAINER_SHIM_LIB = f"{CONTAINER_SHIM_DIR}/libvgpu.so"
CONTAINER_REGION_DIR = "/var/run/kvgpu"
CONTAINER_SCHED_DIR = "/var/run/kvgpu-sched"
#: Where an MPS client container sees its card's pipe directory (the shim's VGPU_CONTAINER_MPS_DIR).
CONTAINER_MPS_DIR = "/var/run/kvgpu-mps"
CONTAINER_CLAIM_DIR = "/etc/kvgpu"
CONTAINER_CLAIM_FILE = f"{CONTAINER_CLAIM_DIR}/claim"


def label_value(value: str) -> str:
    """``value`` as a valid label value (at most 63 characters, alphanumeric at both ends): as it
    is when it already is one, else a prefix of it, cut back to an alphanumeric, plus ``-`` and
    12 hex digits of its SHA-256 (distinct names stay distinct). For node names, which may be
    253 characters long with ``-``/``.`` anywhere."""
    if len(value) <= 63 and (not value or (value[0].isalnum() and value[-1].isalnum())):
        return value
    digest = hashlib.sha256(value.encode()).hexdigest()[:12]
    prefix = value[:50].rstrip("-._")
    return f"{prefix}-{digest}" if prefix else digest


def container_key(container: str) -> str:
    """Return the annotation-safe key for a container name.

    Names of up to 40 characters are used as they are (the longest prefix, ``devices.``,
    leaves room); longer names become ``h-`` + 16 hex digits of their SHA-256.
    """
    if len(container) <= 40:
        return container
    return "h-" + hashlib.sha256(container.encode()).hexdigest()[:16]


def claim_annotation(container: str) -> str:
    """The pod annotation holding the container's ``KVGPU_CLAIM`` string."""
    return CLAIM_PREFIX + container_key(container)


def devices_annotation(container: str) -> str:
    """The pod annotation holding the container's card UUIDs (``NVIDIA_VISIBLE_DEVICES``)."""
    return DEVICES_PREFIX + container_key(container)


def is_allocation_annotation(key: str) -> bool:
    """True for annotations only the operator may write."""
    return key in ALLOCATION_ANNOTATIONS or key.startswith(ALLOCATION_ANNOTATION_PREFIXES)
