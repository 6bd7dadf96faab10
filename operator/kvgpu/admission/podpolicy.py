"""The pod CREATE checks that must hold after *every* mutating webhook, as a ValidatingAdmissionPolicy.

kvgpu's mutating webhook mutates a new pod and validates the result in the same call
(:mod:`kvgpu.admission.handlers`), so a GPU pod costs one webhook call. What that call cannot
see is a mutating webhook that runs after it: one the API server reinvokes after ours, or one
that turns a pod mentioning no GPUs (skipped by our match conditions; the API server never calls
a webhook for the first time on reinvocation) into a GPU pod. :func:`pod_policy` is the
guarantee for those: CEL the API server evaluates on the pod as it will be stored (validating
admission runs after all mutation), with no webhook call and no dependence on the operator
running (``failurePolicy: Fail``).

The mutating webhook marks every pod it admits with :data:`kvgpu.core.keys.POD_ADMITTED`, whose
value is the comma list of the containers (app and init) it gave slices (empty when none). A
later webhook may forge the marker too, so the policy does not trust it beyond naming which
containers are sliced, and checks what those containers may and may not carry by itself. For a
pod that mentions GPUs (the webhooks' ``mentions-gpus`` condition), the policy refuses (the env,
volume and mount rules only for pods with slices or with ``kvgpu.io`` amount annotations: what a
pod without slices sets is its own, as for validation):

* no marker (kvgpu's mutating webhook did not admit this pod: another webhook made it a GPU pod);
* allocation annotations (``kvgpu.io/bound-node``, ``claims``, ``requeue``, ``claim.*``,
  ``devices.*``: the operator writes them at bind time, never on a new pod);
* a container with a non-zero limit or request of kvgpu's slice resources (``nvidia.com/gpu``,
  HAMi's ``nvidia.com/gpumem`` ...; not MIG's ``nvidia.com/mig-*``) that the marker does not list,
  or a listed one without any (an annotation-form container without the ``nvidia.com/gpu`` kvgpu
  adds: the kubelet would not call ``Allocate`` for it);
* a reserved env var (:func:`kvgpu.admission.validate.is_reserved_env`) in any container other
  than in the exact injected shape (:func:`kvgpu.admission.mutate.injected_env` in a listed
  container, ``NVIDIA_VISIBLE_DEVICES=none`` in the others);
* when the pod has slices: a container without ``NVIDIA_VISIBLE_DEVICES`` (an image default of
  ``all`` would show every card), a listed container without its claim mount, another scheduler
  than ``kvgpu-scheduler`` or a preset ``spec.nodeName``, ``hostPID``, a privileged listed
  container or one adding ``SYS_ADMIN``/``SYS_PTRACE``/``ALL``, a ``hostPath`` volume at, above or
  under :data:`kvgpu.admission.validate.SENSITIVE_HOST_PATHS` or not written as a clean absolute
  path;
* a volume under a reserved name that is not exactly a claim volume of a listed container; a mount
  of a reserved volume (:func:`kvgpu.admission.mutate.is_reserved_volume`) or at ``/etc/kvgpu``
  other than a listed container's own claim mount;
  in a listed container a mount at or under a path ``Allocate`` mounts
  (:data:`kvgpu.admission.mutate.DEVICE_PLUGIN_TARGETS`) or a mount path that is not clean
  (``//``, ``/./``, ``/../``).

Container keys (:func:`kvgpu.core.keys.container_key`) are the name up to 40 characters; a
longer name's key is a SHA-256 prefix CEL cannot compute, so for those the policy accepts any
``h-<16 hex>`` key: a long-named container could point its own env at a sibling's claim in the
same pod, never at another pod's.
"""

from __future__ import annotations

from typing import Any

from kvgpu.admission import mutate as m
from kvgpu.admission import validate as v
from kvgpu.admission.config import ALWAYS_EXCLUDED_NAMESPACES, gpu_pod_expression
from kvgpu.api.request_keys import AMOUNT_ANNOTATIONS, HAMI_RESOURCES
from kvgpu.core import keys

POD_POLICY_NAME = f"pods.{keys.GROUP}"
_KINDS = ("containers", "initContainers")
_SENTINEL = "CONTAINERKEYSENTINEL"  # a container name that is its own key (keys.container_key)
_LABELS = {"app.kubernetes.io/name": "kvgpu", "app.kubernetes.io/component": "admission"}


def q(s: str) -> str:
    """``s`` as a CEL string literal."""
    return "'" + s.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _cel_list(items: tuple[str, ...] | list[str]) -> str:
    return "[" + ", ".join(q(i) for i in items) + "]"


def _key_is(name: str, key: str) -> str:
    """CEL: ``key`` (an expression) is the container key of container name ``name``."""
    return f"(size({name}) <= 40 ? {key} == {name} : {key}.matches('^h-[0-9a-f]{{16}}$'))"


def _in_sliced(name: str) -> str:
    return f"({name} != '' && {name} in variables.sliced)"


def _each_container(body: str) -> str:
    """CEL: ``body`` (about ``c``) holds for every app and init container."""
    return " && ".join(f"(!has(object.spec.{k}) || object.spec.{k}.all(c, {body}))" for k in _KINDS)


def _any_container(body: str) -> str:
    return " || ".join(f"(has(object.spec.{k}) && object.spec.{k}.exists(c, {body}))" for k in _KINDS)


def _under(path: str, roots: tuple[str, ...] | list[str]) -> str:
    """CEL: ``path`` is one of ``roots`` or lies under one."""
    return f"{_cel_list(list(roots))}.exists(t, {path} == t || {path}.startsWith(t + '/'))"


def _unclean(path: str, *, absolute: bool = True) -> str:
    """CEL: ``path`` has ``//``, ``.`` or ``..`` steps (the runtime would clean it to another
    path than the one compared), or with ``absolute`` does not start with ``/``."""
    steps = (f"{path}.contains('//') || {path}.contains('/./') || {path}.contains('/../') || "
             f"{path}.endsWith('/.') || {path}.endsWith('/..')")
    return f"(!{path}.startsWith('/') || {steps})" if absolute else f"({steps})"


# The API server's type check does not know ResourceRequirements' quantity maps ("undefined
# field 'limits'"): ``dyn()`` leaves them to the evaluation, which reads them as they are.
def _has_resource(c: str, pred: str) -> str:
    """CEL: container ``c`` has a limit or request ``r`` for which ``pred`` holds."""
    res = f"dyn({c}.resources)"
    return " || ".join(f"(has({c}.resources) && has({res}.{f}) && {res}.{f}.exists(r, {pred}))"
                       for f in ("limits", "requests"))


def _nonzero_gpu_resource(c: str) -> str:
    """CEL: container ``c`` names one of kvgpu's slice resources (``nvidia.com/gpu`` and HAMi's
    per-card amounts), not zero; other ``nvidia.com/`` resources (MIG instances, another
    vendor's plugin) are not kvgpu's slices."""
    res = f"dyn({c}.resources)"
    return " || ".join(
        f"(has({c}.resources) && has({res}.{f}) && {res}.{f}.exists(r, "
        f"r in {_cel_list(list(HAMI_RESOURCES))} && string({res}.{f}[r]) != '0'))" for f in ("limits", "requests"))


def _injected_env_shape(e: str, c: str) -> str:
    """CEL: env entry ``e`` of container ``c`` is one of :func:`kvgpu.admission.mutate.injected_env`."""
    shapes = []
    for want in m.injected_env(_SENTINEL):
        name = q(want["name"])
        if "value" in want:
            shapes.append(f"({e}.name == {name} && has({e}.value) && {e}.value == {q(want['value'])})")
            continue
        path = want["valueFrom"]["fieldRef"]["fieldPath"]
        ref = f"{e}.valueFrom.fieldRef.fieldPath"
        field = f"has({e}.valueFrom) && has({e}.valueFrom.fieldRef)"
        if _SENTINEL not in path:
            shapes.append(f"({e}.name == {name} && {field} && {ref} == {q(path)})")
            continue
        pre, post = path.split(_SENTINEL)
        key = f"{ref}.substring({len(pre)}, size({ref}) - {len(post)})"
        shapes.append(f"({e}.name == {name} && {field} && {ref}.startsWith({q(pre)}) && {ref}.endsWith({q(post)}) "
                      f"&& size({ref}) > {len(pre) + len(post)} && {_key_is(f'{c}.name', key)})")
    return "(" + " || ".join(shapes) + ")"


def _reserved_env(name: str) -> str:
    names = sorted({*keys.RESERVED_ENV, *v.EXTRA_RESERVED_ENV})
    return f"({name} in {_cel_list(names)} || {name}.matches({q(v._INDEXED_RESERVED_ENV.pattern)}))"


def _env_ok() -> str:
    none = (f"(e.name == {q(keys.ENV_VISIBLE)} && has(e.value) && e.value == {q(m.NO_DEVICES)} && "
            f"!{_in_sliced('c.name')})")
    return _each_container(f"!has(c.env) || c.env.all(e, !{_reserved_env('e.name')} || "
                           f"({_in_sliced('c.name')} && {_injected_env_shape('e', 'c')}) || {none})")


def _claim_mount(c: str, mt: str) -> str:
    key = f"{mt}.name.substring({len(m.VOLUME_CLAIM_PREFIX)})"
    return (f"({_in_sliced(f'{c}.name')} && {mt}.name.startsWith({q(m.VOLUME_CLAIM_PREFIX)}) && "
            f"{_key_is(f'{c}.name', key)} && {mt}.mountPath == {q(keys.CONTAINER_CLAIM_DIR)} && "
            f"has({mt}.readOnly) && {mt}.readOnly && (!has({mt}.subPath) || {mt}.subPath == '') && "
            f"(!has({mt}.subPathExpr) || {mt}.subPathExpr == '') && "
            f"(!has({mt}.mountPropagation) || {mt}.mountPropagation == 'None'))")


def _mounts_ok() -> str:
    p = "mt.mountPath"
    claimish = (f"(mt.name in {_cel_list(m.RESERVED_VOLUMES)} || mt.name.startsWith({q(m.VOLUME_CLAIM_PREFIX)}) "
                f"|| {_under(p, [keys.CONTAINER_CLAIM_DIR])})")
    sliced_rules = f"(!{_unclean(p, absolute=False)} && !{_under(p, list(m.DEVICE_PLUGIN_TARGETS))})"
    return _each_container(
        f"!has(c.volumeMounts) || c.volumeMounts.all(mt, (!{claimish} || {_claim_mount('c', 'mt')}) && "
        f"(!{_in_sliced('c.name')} || {claimish} || {sliced_rules}))")


def _volumes_ok() -> str:
    key = f"vol.name.substring({len(m.VOLUME_CLAIM_PREFIX)})"
    item = "vol.downwardAPI.items[0]"
    claim_path = q(f"metadata.annotations['{keys.CLAIM_PREFIX}")
    claim_vol = (f"(variables.sliced.exists(n, n != '' && {_key_is('n', key)}) && has(vol.downwardAPI) && "
                 f"has(vol.downwardAPI.items) && size(vol.downwardAPI.items) == 1 && "
                 f"{item}.path == {q(m.CLAIM_ITEM)} && has({item}.fieldRef) && "
                 f"{item}.fieldRef.fieldPath == {claim_path} + {key} + \"']\")")
    return (f"!has(object.spec.volumes) || object.spec.volumes.all(vol, !(vol.name in {_cel_list(m.RESERVED_VOLUMES)}) "
            f"&& (!vol.name.startsWith({q(m.VOLUME_CLAIM_PREFIX)}) || {claim_vol}))")


def _host_paths_ok() -> str:
    raw = "vol.hostPath.path"
    p = f"({raw}.endsWith('/') && size({raw}) > 1 ? {raw}.substring(0, size({raw}) - 1) : {raw})"
    sensitive = (f"({p} == '/' || {_cel_list(list(v.SENSITIVE_HOST_PATHS))}.exists(s, {p} == s || "
                 f"s.startsWith({p} + '/') || {p}.startsWith(s + '/')))")
    return (f"!variables.admitted || !has(object.spec.volumes) || object.spec.volumes.all(vol, "
            f"!has(vol.hostPath) || (!{_unclean(raw)} && !{sensitive}))")


def _privileges_ok() -> str:
    caps = "c.securityContext.capabilities"
    dangerous = (f"(has(c.securityContext) && has({caps}) && has({caps}.add) && "
                 f"{caps}.add.exists(x, x.upperAscii() in {_cel_list(sorted(v._DANGEROUS_CAPS))}))")
    privileged = "(has(c.securityContext) && has(c.securityContext.privileged) && c.securityContext.privileged)"
    return ("(!variables.admitted || !has(object.spec.hostPID) || !object.spec.hostPID) && "
            + _each_container(f"!{_in_sliced('c.name')} || (!{privileged} && !{dangerous})"))


def _allocation_annotations() -> str:
    exact = _cel_list(list(keys.ALLOCATION_ANNOTATIONS))
    starts = " || ".join(f"k.startsWith({q(p)})" for p in keys.ALLOCATION_ANNOTATION_PREFIXES)
    return (f"!has(object.metadata.annotations) || !object.metadata.annotations.exists(k, k in {exact} || "
            f"{starts})")


def _validations() -> list[dict[str, str]]:
    pre = f"refused after every mutating webhook ({POD_POLICY_NAME}): "
    gpu = f"{m.CARD_RESOURCE}"
    guarded = "!variables.guarded || "
    listed = _each_container(f"!({_nonzero_gpu_resource('c')}) || {_in_sliced('c.name')}")
    # A listed container names nvidia.com/ resources: kvgpu's nvidia.com/gpu in the annotation
    # form (without it the kubelet would not call Allocate), its own in the HAMi form.
    has_card = ("variables.sliced.all(n, n == '' || "
                + _any_container(f"c.name == n && ({_nonzero_gpu_resource('c')})") + ")")
    rules = [
        (f"has(object.metadata.annotations) && {q(keys.POD_ADMITTED)} in object.metadata.annotations",
         f"the pod mentions GPUs but kvgpu's mutating webhook did not admit it (no {keys.POD_ADMITTED} "
         "annotation): a mutating webhook that ran after kvgpu's made it a GPU pod, or the "
         f"MutatingWebhookConfiguration {'kvgpu-mutate'!r} is missing"),
        (_allocation_annotations(),
         "kvgpu.io allocation annotations (bound-node, claims, requeue, claim.*, devices.*) are written by "
         "the kvgpu operator at scheduling time and cannot be set on a new pod"),
        (f"{listed} && {has_card}",
         f"a container's GPU slice resources differ from what kvgpu's mutating webhook admitted "
         f"(annotation {keys.POD_ADMITTED}); each container with slices requests {gpu} (kvgpu adds it) "
         "or HAMi's nvidia.com/ resources"),
        (guarded + _env_ok(),
         "a container sets an env var kvgpu reserves for the GPU slice (KVGPU_*, NVIDIA_VISIBLE_DEVICES, "
         "CUDA_DEVICE_*_LIMIT, LD_PRELOAD, ...) other than as kvgpu injects it"),
        ("!variables.admitted || " + _each_container(
            f"has(c.env) && c.env.exists(e, e.name == {q(keys.ENV_VISIBLE)})"),
         f"a container of a pod with GPU slices lacks {keys.ENV_VISIBLE} (kvgpu sets it in every container)"),
        ("!variables.admitted || " + _each_container(
            f"!{_in_sliced('c.name')} || (has(c.volumeMounts) && c.volumeMounts.exists(mt, "
            f"mt.mountPath == {q(keys.CONTAINER_CLAIM_DIR)} && mt.name.startsWith({q(m.VOLUME_CLAIM_PREFIX)})))"),
         f"a container with GPU slices lacks its claim mount at {keys.CONTAINER_CLAIM_DIR}"),
        (f"!variables.admitted || (has(object.spec.schedulerName) && object.spec.schedulerName == "
         f"{q(keys.SCHEDULER_NAME)} && (!has(object.spec.nodeName) || object.spec.nodeName == ''))",
         f"pods with GPU slices are scheduled by {keys.SCHEDULER_NAME!r} with no preset spec.nodeName"),
        (guarded + _volumes_ok(),
         "a volume uses a name kvgpu reserves (kvgpu-claim-*, kvgpu-shim, kvgpu-claims, ...) other than as "
         "kvgpu injects it; rename the volume"),
        (guarded + _mounts_ok(),
         f"a container mounts kvgpu's claim volume or {keys.CONTAINER_CLAIM_DIR} other than kvgpu does, or a "
         f"container with GPU slices mounts at a path the device plugin mounts ({', '.join(m.DEVICE_PLUGIN_TARGETS)}) "
         "or at an unclean path"),
        (_host_paths_ok(), "a hostPath volume of a pod with GPU slices exposes the node's devices, processes, "
                           "runtime or kvgpu's files, or is not a clean absolute path"),
        (_privileges_ok(), "a container with GPU slices is privileged or adds SYS_ADMIN/SYS_PTRACE/ALL, or "
                           "the pod sets hostPID"),
    ]
    return [{"expression": e, "message": pre + msg, "reason": "Forbidden"} for e, msg in rules]


def pod_policy(exclude_namespaces: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding)`` for pod CREATE, scoped
    like the webhooks: pods that mention GPUs (the same CEL match condition), not in
    ``kube-system`` nor ``exclude_namespaces``. ``failurePolicy: Fail``; the binding denies."""
    admitted = f"object.metadata.annotations[{q(keys.POD_ADMITTED)}]"
    sliced = (f"has(object.metadata.annotations) && {q(keys.POD_ADMITTED)} in object.metadata.annotations ? "
              f"{admitted}.split(',') : ['']")
    excluded = sorted({*ALWAYS_EXCLUDED_NAMESPACES, *exclude_namespaces})
    policy = {
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": POD_POLICY_NAME, "labels": dict(_LABELS)},
        "spec": {
            "failurePolicy": "Fail",
            "matchConstraints": {"resourceRules": [{
                "apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": ["pods"]}]},
            "matchConditions": [{"name": "mentions-gpus", "expression": gpu_pod_expression(update=False)}],
            "variables": [
                {"name": "sliced", "expression": sliced},
                {"name": "admitted", "expression": "variables.sliced.exists(n, n != '')"},
                # Env, volume and mount rules: for pods with slices, or that ask for them (a
                # forged empty marker does not turn them off); validation checks no more.
                {"name": "guarded", "expression": (
                    "variables.admitted || (has(object.metadata.annotations) && object.metadata.annotations"
                    f".exists(k, k in {_cel_list(list(AMOUNT_ANNOTATIONS))}))")},
            ],
            "validations": _validations(),
        },
    }
    binding = {
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": POD_POLICY_NAME, "labels": dict(_LABELS)},
        "spec": {"policyName": POD_POLICY_NAME, "validationActions": ["Deny"],
                 "matchResources": {"namespaceSelector": {"matchExpressions": [
                     {"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": excluded}]}}},
    }
    return policy, binding
