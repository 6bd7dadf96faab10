"""The mutating webhook's decision, as a pure function: pod dict in, JSON-patch ops out.

For a pod that requests slices (and whose request parses), :func:`mutate_pod` returns the ops
that

* address the pod to ``kvgpu-scheduler`` (when it names no scheduler or ``default-scheduler``;
  a pod naming another scheduler is left alone here and rejected by validation),
* label it ``kvgpu.io/managed=true`` (the operator watches only labelled pods),
* prepare every container that gets slices, init containers included, for the shim: env vars
  whose values the kubelet fills from the pod's allocation annotations at container start (after
  the extender has written them at bind time), and the container's own claim, read-only, at
  ``/etc/kvgpu/claim``: one downward-API volume per container with slices (``kvgpu-claim-<key>``,
  the single item ``claim``), so no container can read or point the shim at a sibling's claim;
  the shim takes the claim from that file only (issue 14). **No hostPath**: the shim,
  ``/etc/ld.so.preload``, the container's region directory and the compute schedule come from
  the device plugin's ``Allocate`` (:mod:`kvgpu.agent.allocation`), which PodSecurity does not
  see, so GPU pods run in ``baseline`` and ``restricted`` namespaces (downward-API volumes are
  allowed under both),
* give every container that gets slices from the annotation form (``kvgpu.io/gpu`` ...) the
  extended-resource limit ``nvidia.com/gpu: <cards>`` (unless it names ``nvidia.com/gpu``
  already), so that the kubelet calls the device plugin's ``Allocate`` for it as for the HAMi
  form and kube-scheduler's NodeResourcesFit counts its replicas (one per card),
* set ``NVIDIA_VISIBLE_DEVICES=none`` in the pod's other containers, so an image default
  (CUDA images set ``all``) cannot expose every card of the node to a container without slices
  (:func:`mutate_ephemeral` does the same for debug containers added later).

Idempotent: entries are matched by name (env, volumes, resources) or mount path, so running it
on its own output returns ``[]`` (safe with ``reinvocationPolicy: IfNeeded``). It never
overwrites what the user wrote; a clash (a user env var ``KVGPU_CLAIM``, a user volume called
``kvgpu-shim``, a mount at ``/etc/ld.so.preload`` or another of :data:`DEVICE_PLUGIN_TARGETS`) is
left in place for :mod:`kvgpu.admission.validate` to reject with a message. Pods that do not
request slices, or whose request has errors, get no ops.
"""

from __future__ import annotations

import copy
from collections.abc import Collection, Iterable, Mapping
from typing import Any

from kvgpu.admission.parsing import parse
from kvgpu.core import keys

JSONPatchOp = dict[str, Any]

MANAGED_LABEL = keys.POD_MANAGED_LABEL
DEFAULT_SCHEDULER = "default-scheduler"

# Volumes of older releases (hostPath shim, preload, region, schedule; the shared claims):
# no longer injected, still reserved, so a tenant volume cannot pose as one.
VOLUME_SHIM = "kvgpu-shim"
VOLUME_PRELOAD = "kvgpu-preload"
VOLUME_REGION = "kvgpu-region"
VOLUME_CLAIMS = "kvgpu-claims"
VOLUME_SCHED = "kvgpu-sched"
VOLUME_CLAIM_PREFIX = "kvgpu-claim-"  # + container key: that container's own claim volume
RESERVED_VOLUMES = (VOLUME_SHIM, VOLUME_PRELOAD, VOLUME_REGION, VOLUME_CLAIMS, VOLUME_SCHED)
CLAIM_ITEM = "claim"  # the one file of a claim volume (keys.CONTAINER_CLAIM_FILE in the container)
PRELOAD_MOUNT = "/etc/ld.so.preload"
#: Where the device plugin's ``Allocate`` mounts host paths in a container with slices (the shim
#: directory, ``ld.so.preload``, its region, the compute schedule, an MPS client's pipe folder);
#: a pod's own mount at one of them is refused by validation.
DEVICE_PLUGIN_TARGETS = (keys.CONTAINER_SHIM_DIR, PRELOAD_MOUNT, keys.CONTAINER_REGION_DIR,
                         keys.CONTAINER_SCHED_DIR, keys.CONTAINER_MPS_DIR)
NO_DEVICES = "none"
#: The device plugin's resource (the agent advertises cards x splitCount replicas of it).
CARD_RESOURCE = "nvidia.com/gpu"

CONTAINER_KINDS = ("initContainers", "containers")


# --------------------------------------------------------------------------- the injected shapes


def _field_ref(path: str) -> dict[str, Any]:
    return {"valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": path}}}


def annotation_field_path(annotation: str) -> str:
    return f"metadata.annotations['{annotation}']"


def claim_file(container: str) -> str:
    """Where the container finds its claim: the same fixed path in every container."""
    return keys.CONTAINER_CLAIM_FILE


def claim_volume(container: str) -> str:
    """The name of the container's own claim volume (a DNS label: keys are at most 40 chars)."""
    return VOLUME_CLAIM_PREFIX + keys.container_key(container)


def is_reserved_volume(name: object) -> bool:
    """True for volume names kvgpu injects (users may not define or mount them otherwise)."""
    return isinstance(name, str) and (name in RESERVED_VOLUMES or name.startswith(VOLUME_CLAIM_PREFIX))


def injected_env(container: str) -> list[dict[str, Any]]:
    """The env vars a container with slices gets (``KVGPU_*`` and ``NVIDIA_VISIBLE_DEVICES``)."""
    return [
        {"name": keys.ENV_POD_UID, **_field_ref("metadata.uid")},
        {"name": keys.ENV_CLAIM, **_field_ref(annotation_field_path(keys.claim_annotation(container)))},
        {"name": keys.ENV_VISIBLE, **_field_ref(annotation_field_path(keys.devices_annotation(container)))},
        {"name": keys.ENV_CLAIM_FILE, "value": claim_file(container)},
        {"name": keys.ENV_REGION_DIR, "value": keys.CONTAINER_REGION_DIR},
        {"name": keys.ENV_SCHED_DIR, "value": keys.CONTAINER_SCHED_DIR},
    ]


def no_devices_env() -> dict[str, Any]:
    """The env var a container without slices gets in a pod that has slices."""
    return {"name": keys.ENV_VISIBLE, "value": NO_DEVICES}


def injected_mounts(container: str) -> list[dict[str, Any]]:
    """The container's one injected mount: its claim volume, read-only, on ``/etc/kvgpu`` (a
    directory mount: a root process cannot rename it away (EBUSY) to plant its own file)."""
    return [{"name": claim_volume(container), "mountPath": keys.CONTAINER_CLAIM_DIR, "readOnly": True}]


def injected_volumes(containers: Iterable[str]) -> list[dict[str, Any]]:
    """The pod volumes: one downward-API claim volume per container with slices, holding only
    its claim (no hostPath: the device plugin mounts the host's files)."""
    return [
        {"name": claim_volume(c), "downwardAPI": {"defaultMode": 0o444, "items": [
            {"path": CLAIM_ITEM,
             "fieldRef": {"apiVersion": "v1", "fieldPath": annotation_field_path(keys.claim_annotation(c))}},
        ]}}
        for c in sorted(set(containers))
    ]


# --------------------------------------------------------------------------- the patch


def _escape(token: str) -> str:
    return token.replace("~", "~0").replace("/", "~1")


def _add_entries(
    ops: list[JSONPatchOp], path: str, existing: list[dict[str, Any]] | None,
    wanted: list[dict[str, Any]], key: str,
) -> None:
    """Append ``wanted`` entries whose ``key`` is not already in ``existing`` (a list at ``path``)."""
    if existing is None:
        if wanted:
            ops.append({"op": "add", "path": path, "value": copy.deepcopy(wanted)})
        return
    have = {e.get(key) for e in existing if isinstance(e, Mapping)}
    for w in wanted:
        if w[key] not in have:
            ops.append({"op": "add", "path": f"{path}/-", "value": copy.deepcopy(w)})
            have.add(w[key])


def _add_card_resource(ops: list[JSONPatchOp], base: str, c: Mapping[str, Any], cards: int) -> None:
    """Add ``limits[nvidia.com/gpu] = cards`` to container ``c`` at ``base`` unless it names
    ``nvidia.com/gpu`` already (in limits or requests: the user's value stays, and validation
    refuses it when it disagrees with the annotations). Requests are left absent: the API server
    defaults an extended resource's request to its limit."""
    res = c.get("resources")
    if not isinstance(res, Mapping):
        ops.append({"op": "add", "path": f"{base}/resources",
                    "value": {"limits": {CARD_RESOURCE: str(cards)}}})
        return
    if any(isinstance(res.get(p), Mapping) and CARD_RESOURCE in res[p] for p in ("limits", "requests")):
        return
    limits = res.get("limits")
    if not isinstance(limits, Mapping):
        ops.append({"op": "add", "path": f"{base}/resources/limits", "value": {CARD_RESOURCE: str(cards)}})
    else:
        ops.append({"op": "add", "path": f"{base}/resources/limits/{_escape(CARD_RESOURCE)}",
                    "value": str(cards)})


def mutate_pod(
    pod: Mapping[str, Any], *, sliced: Collection[str] | None = None,
    card_resources: Mapping[str, int] | None = None,
) -> list[JSONPatchOp]:
    """Return the JSON-patch ops that make ``pod`` a kvgpu pod (``[]`` when nothing to do).

    ``sliced`` names the containers (app or init) that get slices and ``card_resources`` the
    ``nvidia.com/gpu`` limits to add (container → cards); by default the pod's request is
    parsed, and a pod that requests nothing or whose request has errors gets no ops.
    """
    if sliced is None:
        parsed = parse(pod)
        if not parsed.ok:
            return []
        sliced = parsed.names()
        if card_resources is None:
            card_resources = dict(parsed.card_resources)
    card_resources = card_resources or {}
    sliced = set(sliced)
    if not sliced:
        return []
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    if not isinstance(meta, Mapping) or not isinstance(spec, Mapping):
        return []  # not a pod the API server would send; validation refuses it
    ops: list[JSONPatchOp] = []

    labels = meta.get("labels")
    if not isinstance(labels, Mapping) or not labels:
        ops.append({"op": "add", "path": "/metadata/labels", "value": {MANAGED_LABEL: "true"}})
    elif labels.get(MANAGED_LABEL) != "true":
        ops.append({"op": "add", "path": f"/metadata/labels/{_escape(MANAGED_LABEL)}", "value": "true"})

    if spec.get("schedulerName") in (None, "", DEFAULT_SCHEDULER):
        ops.append({"op": "add", "path": "/spec/schedulerName", "value": keys.SCHEDULER_NAME})

    _add_entries(ops, "/spec/volumes", spec.get("volumes"), injected_volumes(sliced), "name")

    for kind in CONTAINER_KINDS:
        for i, c in enumerate(spec.get(kind) or []):
            if not isinstance(c, Mapping):
                continue
            name = c.get("name", "")
            base = f"/spec/{kind}/{i}"
            if name in sliced:
                if name in card_resources:
                    _add_card_resource(ops, base, c, card_resources[name])
                _add_entries(ops, f"{base}/env", c.get("env"), injected_env(name), "name")
                _add_entries(ops, f"{base}/volumeMounts", c.get("volumeMounts"), injected_mounts(name),
                             "mountPath")
            else:
                _add_entries(ops, f"{base}/env", c.get("env"), [no_devices_env()], "name")
    return ops


_GPU_ANNOTATION_PREFIXES = (f"{keys.GROUP}/", "nvidia.com/", "hami.io/")


def mentions_gpus(pod: Mapping[str, Any]) -> bool:
    """Python form of the webhooks' CEL match condition at CREATE
    (:func:`kvgpu.admission.config.gpu_pod_expression`): a ``kvgpu.io/``, ``nvidia.com/`` or
    ``hami.io/`` annotation (prefix in any case), a container or init container with an
    ``nvidia.com/`` limit or request, or the managed label."""
    def mapping(v: Any) -> Mapping[str, Any]:
        return v if isinstance(v, Mapping) else {}

    meta = mapping(pod.get("metadata"))
    if any(str(k).lower().startswith(_GPU_ANNOTATION_PREFIXES) for k in mapping(meta.get("annotations"))):
        return True
    if MANAGED_LABEL in mapping(meta.get("labels")):
        return True
    spec = mapping(pod.get("spec"))
    for kind in CONTAINER_KINDS:
        for c in spec.get(kind) or []:
            res = c.get("resources") if isinstance(c, Mapping) else None
            if isinstance(res, Mapping) and any(
                isinstance(res.get(f), Mapping) and any(str(r).startswith("nvidia.com/") for r in res[f])
                for f in ("limits", "requests")
            ):
                return True
    return False


def admitted_ops(pod: Mapping[str, Any]) -> list[JSONPatchOp]:
    """The op that sets :data:`kvgpu.core.keys.POD_ADMITTED` on ``pod`` (as the injection left
    it, already validated) to the sorted comma list of its containers with slices (``""`` when
    none), replacing any value (the user's or an earlier round's); ``[]`` when it is already so,
    or when ``pod`` does not mention GPUs (:func:`mentions_gpus`; the API server sends no such
    pod). The pod policy (:mod:`kvgpu.admission.podpolicy`) refuses a pod that mentions GPUs
    without it."""
    if not mentions_gpus(pod):
        return []
    parsed = parse(pod)
    value = ",".join(sorted(parsed.names())) if parsed.ok else ""
    meta = pod.get("metadata") or {}
    ann = meta.get("annotations") if isinstance(meta, Mapping) else None
    if not isinstance(ann, Mapping) or not ann:
        return [{"op": "add", "path": "/metadata/annotations", "value": {keys.POD_ADMITTED: value}}]
    if ann.get(keys.POD_ADMITTED) == value:
        return []
    return [{"op": "add", "path": f"/metadata/annotations/{_escape(keys.POD_ADMITTED)}", "value": value}]


def mutate_ephemeral(pod: Mapping[str, Any]) -> list[JSONPatchOp]:
    """Ops for an UPDATE of ``pods/ephemeralcontainers`` (``kubectl debug``): in a pod with
    slices, every ephemeral container without ``NVIDIA_VISIBLE_DEVICES`` gets ``none``."""
    if not parse(pod).requests_slices:
        return []
    ops: list[JSONPatchOp] = []
    for i, c in enumerate((pod.get("spec") or {}).get("ephemeralContainers") or []):
        _add_entries(ops, f"/spec/ephemeralContainers/{i}/env", c.get("env"), [no_devices_env()], "name")
    return ops


def apply_ops(pod: Mapping[str, Any], ops: list[JSONPatchOp]) -> dict[str, Any]:
    """Apply ``ops`` (as produced by :func:`mutate_pod`: ``add`` only) to a copy of ``pod``."""
    out: dict[str, Any] = copy.deepcopy(dict(pod))
    for op in ops:
        if op["op"] != "add":
            raise ValueError(f"unsupported op {op['op']!r}")
        tokens = [t.replace("~1", "/").replace("~0", "~") for t in op["path"].split("/")[1:]]
        target: Any = out
        for t in tokens[:-1]:
            target = target[int(t)] if isinstance(target, list) else target[t]
        last = tokens[-1]
        if isinstance(target, list):
            if last == "-":
                target.append(copy.deepcopy(op["value"]))
            else:
                target.insert(int(last), copy.deepcopy(op["value"]))
        else:
            target[last] = copy.deepcopy(op["value"])
    return out
