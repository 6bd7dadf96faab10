"""The validating webhook's decision, as a pure function: every reason to refuse, at once.

:func:`validate_pod` returns a list of messages, each naming what is wrong and what to do
(empty: allowed). Validating webhooks run after every mutating one, so at CREATE it sees the
pod as it will be stored, our own injection included; the injected entries are recognised by
their exact shape (:mod:`kvgpu.admission.mutate`), anything else under a reserved name is the
user's and refused. That also makes a pod that requests slices but was *not* injected (the
mutating webhook missing or bypassed) fail closed instead of running without limits.

CREATE, for pods that request slices:

* every request error from the parser (key, value, allowed form);
* a scheduler other than ``kvgpu-scheduler`` (after mutation only a foreign one can remain);
* ``spec.nodeName`` preset (it would skip the scheduler, so no card would be allocated);
* privileged containers, and containers adding ``SYS_ADMIN``/``SYS_PTRACE``/``ALL``, among those
  with slices (they can unmount or bypass the shim, or rewrite its memory); ``hostPID``; a
  ``hostPath`` volume (any container's) that is ``/`` or exposes the node's devices, processes,
  runtime sockets or kvgpu's host directories (:data:`SENSITIVE_HOST_PATHS`, the path itself, a
  parent or a child of one): kvgpu injects no hostPath (the device plugin mounts its host files),
  so any such volume is the tenant's, e.g. the region root or the schedule to forge usage;
* reserved env vars (:func:`is_reserved_env`: :data:`kvgpu.core.keys.RESERVED_ENV` and a few
  more shim inputs) set by the user in any container (``envFrom`` and image defaults cannot be
  seen here: the injected explicit env wins over both for the injected names);
* the injection incomplete or altered (reserved volumes, the claim mount, the ``nvidia.com/gpu``
  limit of an annotation-form container; a limit that disagrees with the annotations is a
  request error from the parser, naming ``nvidia.com/gpu`` and the container), and a mount of the
  pod's own at a path the device plugin mounts (:data:`kvgpu.admission.mutate.DEVICE_PLUGIN_TARGETS`)
  in a container with slices.

CREATE, for every pod reaching the webhook: allocation annotations
(:func:`kvgpu.core.keys.is_allocation_annotation`) are refused whoever sets them — only the
operator writes them, and only on existing pods; the ``kvgpu.io/managed`` label on a pod that
requests no slices (the operator would watch it for nothing).

UPDATE of ``pods`` and of ``pods/status`` (whose writes may change labels and annotations
too), by anyone not in ``operator_usernames``: any change to allocation annotations, to the
``kvgpu.io/managed`` label or to the request annotations (the injection was made for the request
as it was at CREATE); for ``pods`` also any privilege above that the old pod did not have. The
operator's own updates are not second-guessed.

UPDATE of ``pods/ephemeralcontainers`` (``kubectl debug``), by anyone, on a pod with slices: an
ephemeral container may not set reserved env vars (the mutating webhook gives it
``NVIDIA_VISIBLE_DEVICES=none`` so a CUDA debug image cannot see every card of the node), and a
new one may not be privileged nor add ``SYS_ADMIN``/``SYS_PTRACE``/``ALL`` (``kubectl debug
--profile=sysadmin`` or ``general``; it could reach the sliced processes: use ``--profile=baseline``
or ``restricted``).
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Collection, Mapping
from typing import Any

from kvgpu.admission import mutate as m
from kvgpu.admission.parsing import is_request_annotation, parse
from kvgpu.api import requests as api_requests
from kvgpu.api.pools import SliceMinimum
from kvgpu.api.requests import pod_template
from kvgpu.core import keys

EPHEMERAL = "ephemeralcontainers"
STATUS = "status"
_DANGEROUS_CAPS = frozenset({"SYS_ADMIN", "ALL", "CAP_SYS_ADMIN", "SYS_PTRACE", "CAP_SYS_PTRACE"})
#: Host paths that give a container in a pod with slices a way around them: the node's devices,
#: processes and kernel knobs, the runtimes' and kubelet's state and sockets, kvgpu's shim and its
#: per-container regions and schedules. A hostPath volume at one of them, under one, or above one
#: (``/``, ``/var``, ``/usr``) is refused (kvgpu's webhook injects none).
SENSITIVE_HOST_PATHS = (
    "/dev", "/proc", "/sys", "/run", "/var/run", "/var/lib/kubelet", "/var/lib/containerd",
    "/var/lib/docker", "/var/lib/kvgpu", "/usr/local/kvgpu", "/etc/ld.so.preload",
)

#: Besides :data:`kvgpu.core.keys.RESERVED_ENV`, shim inputs that would loosen a slice's limits or
#: raise its priority: HAMi-core's per-device limits, core policy (``disable``) and task priority,
#: and the shim's compute-coordination directory.
EXTRA_RESERVED_ENV = frozenset({"GPU_CORE_UTILIZATION_POLICY", "CUDA_TASK_PRIORITY", "KVGPU_SCHED_DIR"})
_INDEXED_RESERVED_ENV = re.compile(r"^(CUDA_DEVICE_MEMORY_LIMIT|CUDA_DEVICE_SM_LIMIT)_[0-9]+$")


def is_reserved_env(name: str) -> bool:
    """True for env var names a user may not set in a pod with slices."""
    return name in keys.RESERVED_ENV or name in EXTRA_RESERVED_ENV or bool(_INDEXED_RESERVED_ENV.match(name))


def _mapping(v: Any) -> Mapping[str, Any]:
    return v if isinstance(v, Mapping) else {}


def _list(v: Any) -> list[Any]:
    return v if isinstance(v, list) else []


def _containers(pod: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any]]]:
    spec = _mapping(pod.get("spec"))
    return [
        ("init container" if kind == "initContainers" else "container", c)
        for kind in m.CONTAINER_KINDS
        for c in _list(spec.get(kind))
        if isinstance(c, Mapping)
    ]


def _annotations(pod: Mapping[str, Any] | None) -> dict[str, str]:
    if not pod:
        return {}
    ann = _mapping(_mapping(pod.get("metadata")).get("annotations"))
    return {str(k): str(v) for k, v in ann.items()}


def _labels(pod: Mapping[str, Any] | None) -> dict[str, str]:
    if not pod:
        return {}
    lab = _mapping(_mapping(pod.get("metadata")).get("labels"))
    return {str(k): str(v) for k, v in lab.items()}


# --------------------------------------------------------------------------- shape checks


def _same_env(have: Mapping[str, Any], want: Mapping[str, Any]) -> bool:
    if "value" in want:
        return have.get("valueFrom") is None and have.get("value") == want["value"]
    if have.get("value"):
        return False
    ref = _mapping(_mapping(have.get("valueFrom")).get("fieldRef"))
    if set(_mapping(have.get("valueFrom"))) - {"fieldRef"}:
        return False
    want_ref = want["valueFrom"]["fieldRef"]
    return ref.get("fieldPath") == want_ref["fieldPath"] and ref.get("apiVersion") in (None, "v1")


def _same_mount(have: Mapping[str, Any], want: Mapping[str, Any]) -> bool:
    return (
        have.get("name") == want["name"]
        and have.get("mountPath") == want["mountPath"]
        and bool(have.get("readOnly")) == bool(want.get("readOnly"))
        and (have.get("subPathExpr") or "") == (want.get("subPathExpr") or "")
        and not have.get("subPath")
        and have.get("mountPropagation") in (None, "None")
    )


def _same_volume(have: Mapping[str, Any], want: Mapping[str, Any]) -> bool:
    sources = set(have) - {"name"}
    dapi = _mapping(have.get("downwardAPI"))
    if sources != {"downwardAPI"}:
        return False
    items = {
        (str(i.get("path")), str(_mapping(i.get("fieldRef")).get("fieldPath")))
        for i in _list(dapi.get("items")) if isinstance(i, Mapping) and not i.get("resourceFieldRef")
    }
    want_items = {(i["path"], i["fieldRef"]["fieldPath"]) for i in want["downwardAPI"]["items"]}
    return items == want_items


def _env_errors(kind: str, c: Mapping[str, Any], sliced: bool) -> list[str]:
    name = str(c.get("name", ""))
    allowed: dict[str, dict[str, Any]] = (
        {e["name"]: e for e in m.injected_env(name)} if sliced
        else {keys.ENV_VISIBLE: m.no_devices_env()}
    )
    errors = []
    for e in _list(c.get("env")):
        if not isinstance(e, Mapping):
            continue
        ename = e.get("name")
        if not isinstance(ename, str) or not is_reserved_env(ename):
            continue
        want = allowed.get(str(ename))
        if want is not None and _same_env(e, want):
            continue
        errors.append(
            f"{kind} {name!r} sets env {ename}, which kvgpu reserves for the GPU slice; remove it "
            "(kvgpu sets it from the pod's allocation)"
        )
    return errors


def _injection_errors(
    pod: Mapping[str, Any], sliced: Collection[str], card_resources: Collection[tuple[str, int]] = (),
) -> list[str]:
    """Clashes with the injection (one message each) and, if anything is missing, one message
    saying the mutating webhook did not run. ``card_resources``: the ``nvidia.com/gpu`` limits
    the mutation would add (:attr:`kvgpu.admission.parsing.Parsed.card_resources`)."""
    spec = _mapping(pod.get("spec"))
    errors: list[str] = []
    missing: list[str] = [f"limit {m.CARD_RESOURCE}: {n} in container {c!r}" for c, n in card_resources]
    if (spec.get("schedulerName") or m.DEFAULT_SCHEDULER) == m.DEFAULT_SCHEDULER:
        missing.append(f"spec.schedulerName {keys.SCHEDULER_NAME}")
    volumes = {str(v.get("name")): v for v in _list(spec.get("volumes")) if isinstance(v, Mapping)}
    wanted = {w["name"]: w for w in m.injected_volumes(sliced)}
    for want in wanted.values():
        have = volumes.get(want["name"])
        if have is None:
            missing.append(f"volume {want['name']}")
        elif not _same_volume(have, want):
            errors.append(f"volume name {want['name']!r} is reserved by kvgpu; rename your volume")
    errors += [f"volume name {n!r} is reserved by kvgpu; rename your volume"
               for n in volumes if m.is_reserved_volume(n) and n not in wanted]
    for kind, c in _containers(pod):
        name = str(c.get("name", ""))
        mounts = [v for v in _list(c.get("volumeMounts")) if isinstance(v, Mapping)]
        by_path = {str(v.get("mountPath", "")).rstrip("/") or "/": v for v in mounts}
        if name in sliced:
            env = {str(e.get("name")) for e in _list(c.get("env")) if isinstance(e, Mapping)}
            lacking = [w["name"] for w in m.injected_env(name) if w["name"] not in env]
            if lacking:
                missing.append(f"env {', '.join(lacking)} in {kind} {name!r}")
            for want in m.injected_mounts(name):
                have = by_path.get(want["mountPath"])
                if have is None:
                    missing.append(f"mount {want['mountPath']} in {kind} {name!r}")
                elif not _same_mount(have, want):
                    errors.append(f"{kind} {name!r} mounts something else at {want['mountPath']}, "
                                  "which kvgpu reserves for the GPU slice; use another path")
            errors += [f"{kind} {name!r} mounts something else at {t}, which kvgpu reserves for the GPU "
                       "slice (the device plugin mounts it); use another path"
                       for t in m.DEVICE_PLUGIN_TARGETS if t in by_path]
        for v in mounts:
            vname = v.get("name")
            if m.is_reserved_volume(vname) and (name not in sliced or not any(
                _same_mount(v, w) for w in m.injected_mounts(name)
            )):
                errors.append(f"{kind} {name!r} mounts kvgpu's volume {vname!r} in a way kvgpu does not; "
                              "remove that mount")
    if missing:
        errors.append("the pod requests GPU slices but was not prepared by kvgpu's mutating webhook "
                      f"(missing: {'; '.join(missing)}); check that the MutatingWebhookConfiguration "
                      f"{'kvgpu-mutate'!r} exists and the operator runs")
    return errors


def _privilege_errors(kind: str, c: Mapping[str, Any], what: str = "requests GPU slices") -> list[str]:
    name = c.get("name")
    sc = _mapping(c.get("securityContext"))
    errors = []
    if sc.get("privileged") is True:
        errors.append(f"{kind} {name!r} is privileged and {what}; a privileged container "
                      "can bypass the slice limits: drop privileged or request a whole card without kvgpu")
    caps = {str(x).upper() for x in _list(_mapping(sc.get("capabilities")).get("add"))}
    if caps & _DANGEROUS_CAPS:
        errors.append(f"{kind} {name!r} adds capability {', '.join(sorted(caps & _DANGEROUS_CAPS))} and "
                      f"{what}; it could unmount or rewrite the slice limits: drop that capability")
    return errors


def sensitive_host_path(path: str) -> bool:
    """True for a host path that is, contains or lies under one of :data:`SENSITIVE_HOST_PATHS`."""
    p = posixpath.normpath("/" + path.strip())
    if p.startswith("//"):
        p = "/" + p.lstrip("/")
    if p == "/":
        return True
    return any(s == p or s.startswith(p + "/") or p.startswith(s + "/") for s in SENSITIVE_HOST_PATHS)


def _pod_privilege_errors(pod: Mapping[str, Any], sliced: Collection[str]) -> list[str]:
    """Pod-wide ways around the slices: ``hostPID`` and sensitive ``hostPath`` volumes."""
    spec = _mapping(pod.get("spec"))
    errors = []
    if spec.get("hostPID") is True:
        errors.append("spec.hostPID is set and the pod requests GPU slices; it would see and could "
                      "trace the node's processes: drop hostPID")
    for v in _list(spec.get("volumes")):
        if not isinstance(v, Mapping) or not isinstance(v.get("hostPath"), Mapping):
            continue
        path = str(_mapping(v.get("hostPath")).get("path", ""))
        if sensitive_host_path(path):
            errors.append(f"volume {v.get('name')!r} mounts host path {path!r} and the pod requests GPU "
                          "slices; it exposes the node's devices, processes or kvgpu's files: use a "
                          "narrower host path or another volume type")
    return errors


def _forged_annotation_errors(pod: Mapping[str, Any]) -> list[str]:
    forged = sorted(k for k in _annotations(pod) if keys.is_allocation_annotation(k))
    if not forged:
        return []
    return [f"annotation {', '.join(forged)} is written by the kvgpu operator at scheduling time and "
            "cannot be set on a new pod; remove it (copying a running pod's manifest? drop kvgpu.io "
            "allocation annotations)"]


def _create_errors(pod: Mapping[str, Any], *, injected: bool = True,
                   min_slice: SliceMinimum | None = None) -> list[str]:
    errors = _forged_annotation_errors(pod)
    parsed = parse(pod)
    if not parsed.requests_slices:
        if m.MANAGED_LABEL in _labels(pod):
            errors.append(f"label {m.MANAGED_LABEL} is set by kvgpu on pods that request GPU slices; "
                          "remove it")
        return errors
    errors += parsed.errors
    minimum = min_slice or SliceMinimum()
    errors += [str(e) for e in api_requests.slice_minimum_errors(pod, minimum.mib, minimum.source)]
    spec = _mapping(pod.get("spec"))
    scheduler = spec.get("schedulerName") or m.DEFAULT_SCHEDULER
    if scheduler not in (keys.SCHEDULER_NAME, m.DEFAULT_SCHEDULER):
        errors.append(f"spec.schedulerName is {scheduler!r}, but pods that request GPU slices must be "
                      f"scheduled by {keys.SCHEDULER_NAME!r}; remove schedulerName (kvgpu sets it)")
    if spec.get("nodeName"):
        errors.append(f"spec.nodeName is preset to {spec['nodeName']!r}; pods that request GPU slices must "
                      "go through the kvgpu scheduler: use a nodeSelector or node affinity instead")
    sliced = parsed.names()
    errors += _key_collision_errors(pod)
    errors += _all_privilege_errors(pod)
    for kind, c in _containers(pod):
        errors += _env_errors(kind, c, c.get("name") in sliced)
    if injected and not parsed.errors:
        errors += _injection_errors(pod, sliced, parsed.card_resources)
    return errors


def _key_collision_errors(pod: Mapping[str, Any]) -> list[str]:
    """Two containers whose annotation keys (:func:`keys.container_key`) are equal would share one
    claim annotation — a name like ``h-<16 hex>`` equals the hashed key of a long name."""
    by_key: dict[str, list[str]] = {}
    for _kind, c in _containers(pod):
        name = str(c.get("name") or "")
        by_key.setdefault(keys.container_key(name), []).append(name)
    return [f"containers {' and '.join(repr(n) for n in names)} would share kvgpu's annotation key {key!r} "
            "(names of the form h-<16 hex digits> stand for container names longer than 40 characters): "
            "rename one of them" for key, names in by_key.items() if len(names) > 1]


def _all_privilege_errors(pod: Mapping[str, Any]) -> list[str]:
    """Every privilege a pod with slices may not have (none for a pod without)."""
    parsed = parse(pod)
    if not parsed.requests_slices:
        return []
    sliced = parsed.names()
    errors = _pod_privilege_errors(pod, sliced)
    for kind, c in _containers(pod):
        if c.get("name") in sliced:
            errors += _privilege_errors(kind, c)
    return errors


def _request_keys(ann: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in ann.items() if is_request_annotation(k)}


def _ephemeral_errors(pod: Mapping[str, Any], old: Mapping[str, Any] | None = None) -> list[str]:
    """Ephemeral containers (``kubectl debug``) in a pod with slices: no reserved env vars but
    ``NVIDIA_VISIBLE_DEVICES=none``, which the mutating webhook sets; new ones (not in ``old``)
    neither privileged nor with dangerous capabilities."""
    if not parse(pod).requests_slices:
        return []
    had = {str(c.get("name")) for c in _list(_mapping(_mapping(old).get("spec")).get("ephemeralContainers"))
           if isinstance(c, Mapping)}
    errors = []
    for c in _list(_mapping(pod.get("spec")).get("ephemeralContainers")):
        if isinstance(c, Mapping):
            errors += _env_errors("ephemeral container", c, sliced=False)
            if str(c.get("name")) not in had:
                errors += _privilege_errors("ephemeral container", c, "joins a pod with GPU slices "
                                            "(use kubectl debug --profile=baseline or restricted)")
    return errors


def _update_errors(pod: Mapping[str, Any], old: Mapping[str, Any] | None, *, spec: bool = True) -> list[str]:
    errors: list[str] = []
    new_ann, old_ann = _annotations(pod), _annotations(old)
    changed = sorted(
        k for k in set(new_ann) | set(old_ann)
        if keys.is_allocation_annotation(k) and new_ann.get(k) != old_ann.get(k)
    )
    if changed:
        errors.append(f"annotation {', '.join(changed)} may only be changed by the kvgpu operator; "
                      "leave kvgpu.io allocation annotations as they are")
    new_l, old_l = _labels(pod).get(m.MANAGED_LABEL), _labels(old).get(m.MANAGED_LABEL)
    if new_l != old_l:
        errors.append(f"label {m.MANAGED_LABEL} may only be changed by the kvgpu operator")
    new_req, old_req = _request_keys(new_ann), _request_keys(old_ann)
    changed = sorted(k for k in set(new_req) | set(old_req) if new_req.get(k) != old_req.get(k))
    if changed:
        # The shim was injected (or not) at CREATE for the request as it was then; a changed
        # request would no longer match the pod's containers.
        errors.append(f"annotation {', '.join(changed)} is part of the pod's GPU request, which is fixed "
                      "when the pod is created; create a new pod (or change the Deployment's template)")
    if spec:
        before = set(_all_privilege_errors(old)) if old else set()
        errors += [e for e in _all_privilege_errors(pod) if e not in before]
    return errors


def validate_workload(
    operation: str, obj: Mapping[str, Any], old_obj: Mapping[str, Any] | None,
    *, min_slice: SliceMinimum | None = None,
) -> list[str]:
    """The checks of a pod CREATE, applied to a workload's pod template (Deployment, StatefulSet,
    DaemonSet, ReplicaSet, Job, CronJob, ReplicationController, PodTemplate), so that a bad
    request is refused at ``kubectl apply`` instead of surfacing later as FailedCreate events on
    a ReplicaSet. The injection itself is not expected in templates. An UPDATE that leaves the
    pod template as it was is always allowed (scaling, labels, garbage collection)."""
    if not isinstance(obj, Mapping):
        return []
    try:
        meta, spec = pod_template(obj)
    except Exception:  # not a workload we understand: not ours to refuse
        return []
    if operation == "UPDATE" and isinstance(old_obj, Mapping):
        try:
            if pod_template(old_obj) == (meta, spec):
                return []
        except Exception:
            pass
    elif operation != "CREATE":
        return []
    return [f"pod template: {e}" for e in _create_errors({"metadata": meta, "spec": spec}, injected=False,
                                                         min_slice=min_slice)]


def validate_pod(
    operation: str,
    pod: Mapping[str, Any],
    old_pod: Mapping[str, Any] | None,
    username: str,
    operator_usernames: Collection[str],
    *,
    subresource: str | None = None,
    min_slice: SliceMinimum | None = None,
) -> list[str]:
    """Every reason to refuse this admission request; ``[]`` means allowed. Never raises on
    malformed input (an unparsable value is a message, not a crash). ``min_slice``: the smallest
    ``gpumem`` a CREATE may name (:func:`kvgpu.api.pools.slice_minimum`; None: kvgpu's default).

    ``subresource`` ``"ephemeralcontainers"`` (an UPDATE adding debug containers) checks only
    the ephemeral containers; ``"status"`` the labels and annotations a status write may change;
    other subresources are allowed.
    """
    if not isinstance(pod, Mapping):
        return []
    old = old_pod if isinstance(old_pod, Mapping) else None
    if subresource == EPHEMERAL:
        return _ephemeral_errors(pod, old) if operation == "UPDATE" else []
    if subresource == STATUS:
        if operation != "UPDATE" or username in operator_usernames:
            return []
        return _update_errors(pod, old, spec=False)
    if subresource:
        return []
    if operation == "CREATE":
        return _create_errors(pod, min_slice=min_slice)
    if operation == "UPDATE":
        if username in operator_usernames:
            return []
        return _update_errors(pod, old)
    return []
