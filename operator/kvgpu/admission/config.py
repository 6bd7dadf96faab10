"""Our own Mutating/ValidatingWebhookConfiguration objects (Kopf's managed mode is not used).

Same objects for dev mode (``url_base`` such as ``https://127.0.0.1:9443``, the API server
calls the operator process directly) and production manifests (``service`` reference).

Scope, from the outside in: pods (CREATE to the mutating webhook, which validates the pod in the
same call, so a new pod costs one webhook call; UPDATE to the validating one; what mutating
webhooks after ours do at CREATE is checked by the ValidatingAdmissionPolicy of
:mod:`kvgpu.admission.podpolicy`, without a webhook call), pods/ephemeralcontainers
(UPDATE, ``kubectl debug``) and, for validation, pods/status (UPDATE: a status write may change
labels and annotations too; only writes that change a ``kvgpu.io/`` annotation or the managed
label are sent, so the kubelet's status updates never wait for the webhook); not in
``kube-system`` nor the excluded namespaces (the operator's own, so a broken webhook can never
block the operator's pod); and, through CEL
``matchConditions`` evaluated by the API server, only pods that mention GPUs at all — a
``kvgpu.io/``, ``nvidia.com/`` or ``hami.io/`` annotation, or a container/init container with an
``nvidia.com/`` limit or request (for UPDATE also a pod that *had* ``kvgpu.io/`` annotations or
the managed label, so removing them is seen). A third webhook validates the pod templates of
workloads (Deployment, Job, CronJob, ...) that mention GPUs (or whose own annotations do, to warn
that those never reach the pods), so a bad request is refused at
``kubectl apply`` rather than showing up later as FailedCreate events. Every other object never
reaches the operator, so ``failurePolicy: Fail`` costs nothing for them and closes the
"webhook down ⇒ pod runs unlimited" hole HAMi has with ``Ignore``.
"""

from __future__ import annotations

import base64
from typing import Any

from kvgpu.admission.handlers import MUTATE_ID, VALIDATE_ID, VALIDATE_WORKLOADS_ID, WORKLOADS
from kvgpu.admission.mutate import MANAGED_LABEL
from kvgpu.core import keys

MUTATE_NAME = "kvgpu-mutate"
VALIDATE_NAME = "kvgpu-validate"
MUTATE_WEBHOOK = f"pods.mutate.{keys.GROUP}"
VALIDATE_WEBHOOK = f"pods.validate.{keys.GROUP}"
WORKLOADS_WEBHOOK = f"workloads.validate.{keys.GROUP}"
TIMEOUT_S = 5
EPHEMERAL_RESOURCE = "pods/ephemeralcontainers"  # kubectl debug: see mutate.mutate_ephemeral
STATUS_RESOURCE = "pods/status"  # validated only where it changes kvgpu's labels or annotations
ALWAYS_EXCLUDED_NAMESPACES = ("kube-system",)

_ANNOTATION_PREFIXES = (f"{keys.GROUP}/", "nvidia.com/", "hami.io/")


def _any_annotation(obj: str, prefixes: tuple[str, ...]) -> str:
    """CEL: ``obj`` has an annotation under one of ``prefixes``, the prefix in any case (the API
    server accepts ``Kvgpu.io/gpumem``; such keys are refused with the right spelling)."""
    starts = " || ".join(f"k.lowerAscii().startsWith('{p}')" for p in prefixes)
    return (f"({obj} != null && has({obj}.metadata) && has({obj}.metadata.annotations) && "
            f"{obj}.metadata.annotations.exists(k, {starts}))")


def _any_container_resource(spec: str, field: str) -> str:
    def in_map(m: str) -> str:
        return f"(has(c.resources.{m}) && c.resources.{m}.exists(r, r.startsWith('nvidia.com/')))"

    return (f"(has({spec}.{field}) && {spec}.{field}.exists(c, has(c.resources) && "
            f"({in_map('limits')} || {in_map('requests')})))")


def _mentions_gpus(pod: str) -> list[str]:
    """CEL parts: ``pod`` (a Pod or a pod template expression) mentions GPUs."""
    return [
        _any_annotation(pod, _ANNOTATION_PREFIXES),
        f"(has({pod}.spec) && ({_any_container_resource(f'{pod}.spec', 'containers')} || "
        f"{_any_container_resource(f'{pod}.spec', 'initContainers')}))",
    ]


def _has_managed_label(obj: str) -> str:
    return (f"({obj} != null && has({obj}.metadata) && has({obj}.metadata.labels) && "
            f"'{MANAGED_LABEL}' in {obj}.metadata.labels)")


def gpu_pod_expression(*, update: bool) -> str:
    """CEL: true for pods that mention GPUs or carry the managed label (a CREATE with it on a pod
    that requests no slices is refused). With ``update`` (the validating webhook, UPDATE only)
    also for pods that were kvgpu pods before."""
    parts = _mentions_gpus("object")
    parts.append(_has_managed_label("object"))
    if update:
        parts.append(_any_annotation("oldObject", (f"{keys.GROUP}/",)))
        parts.append(_has_managed_label("oldObject"))
    return " || ".join(parts)


def _kvgpu_metadata_changed() -> str:
    """CEL: the UPDATE changes a ``kvgpu.io/`` annotation or the managed label (``object`` vs
    ``oldObject``; either may lack annotations or labels)."""
    def changed(new: str, old: str) -> str:
        n, o = f"{new}.metadata.annotations", f"{old}.metadata.annotations"
        return (f"(has({n}) && {n}.exists(k, k.startsWith('{keys.GROUP}/') && "
                f"(!has({o}) || !(k in {o}) || {o}[k] != {n}[k])))")

    def label(obj: str) -> str:
        lab = f"{obj}.metadata.labels"
        return f"(has({lab}) && '{MANAGED_LABEL}' in {lab} ? {lab}['{MANAGED_LABEL}'] : '')"

    return (f"{changed('object', 'oldObject')} || {changed('oldObject', 'object')} || "
            f"{label('object')} != {label('oldObject')}")


def status_expression() -> str:
    """CEL: not a ``pods/status`` write, or one that changes kvgpu's metadata."""
    return f"!has(request.subResource) || request.subResource != 'status' || {_kvgpu_metadata_changed()}"


#: Where each workload keeps its pod template (CEL, ``object`` being the workload).
_TEMPLATES = {
    "cronjobs": "object.spec.jobTemplate.spec.template",
    "podtemplates": "object.template",
}
_DEFAULT_TEMPLATE = "object.spec.template"


def gpu_workload_expression() -> str:
    """CEL: true for workloads whose pod template mentions GPUs."""
    def parent(path: str) -> str:  # has(a.b) && has(a.b.c) && ...: no step may be missing
        parts = path.split(".")
        return " && ".join(f"has({'.'.join(parts[: i + 1])})" for i in range(1, len(parts)))

    branches = []
    for plural, path in _TEMPLATES.items():
        branches.append(f"(request.resource.resource == '{plural}' && {parent(path)} && "
                        f"({' || '.join(_mentions_gpus(path))}))")
    others = " && ".join(f"request.resource.resource != '{p}'" for p in _TEMPLATES)
    branches.append(f"({others} && {parent(_DEFAULT_TEMPLATE)} && "
                    f"({' || '.join(_mentions_gpus(_DEFAULT_TEMPLATE))}))")
    # GPU annotations on the workload's own metadata never reach its pods: warned about.
    branches.append(_any_annotation("object", _ANNOTATION_PREFIXES))
    return " || ".join(branches)


def _client_config(
    path: str, url_base: str | None, service: tuple[str, str, int] | None, ca_bundle: bytes,
) -> dict[str, Any]:
    if (url_base is None) == (service is None):
        raise ValueError("give exactly one of url_base and service")
    cfg: dict[str, Any] = {"caBundle": base64.b64encode(ca_bundle).decode()} if ca_bundle else {}
    if url_base is not None:
        cfg["url"] = f"{url_base.rstrip('/')}/{path}"
    else:
        assert service is not None
        ns, name, port = service
        cfg["service"] = {"namespace": ns, "name": name, "port": int(port), "path": f"/{path}"}
    return cfg


def _rule(operations: list[str], resources: list[str], group: str = "") -> dict[str, Any]:
    return {"apiGroups": [group], "apiVersions": ["v1"], "operations": operations, "resources": resources,
            "scope": "Namespaced"}


def _webhook(
    name: str, path: str, rules: list[dict[str, Any]], *, expression: str, url_base: str | None,
    service: tuple[str, str, int] | None, ca_bundle: bytes, exclude_namespaces: list[str],
) -> dict[str, Any]:
    excluded = sorted({*ALWAYS_EXCLUDED_NAMESPACES, *exclude_namespaces})
    return {
        "name": name,
        "clientConfig": _client_config(path, url_base, service, ca_bundle),
        "rules": rules,
        "failurePolicy": "Fail",
        "matchPolicy": "Equivalent",
        "sideEffects": "None",
        "timeoutSeconds": TIMEOUT_S,
        "admissionReviewVersions": ["v1"],
        "namespaceSelector": {"matchExpressions": [
            {"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": excluded}]},
        "objectSelector": {},
        "matchConditions": [{"name": "mentions-gpus", "expression": expression}],
    }


def webhook_configurations(
    *,
    url_base: str | None,
    service: tuple[str, str, int] | None,
    ca_bundle: bytes,
    exclude_namespaces: list[str],
    annotations: dict[str, str] | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Return ``(MutatingWebhookConfiguration, ValidatingWebhookConfiguration)`` dicts.

    ``url_base``: the operator's webhook server as the API server reaches it (dev mode);
    ``service``: ``(namespace, name, port)`` of its Service (production). Exactly one of the two.
    ``ca_bundle``: PEM of the CA that signed the server certificate; empty leaves ``caBundle``
    out, for an injector to fill (e.g. cert-manager's, with ``annotations``
    ``{"cert-manager.io/inject-ca-from": "<namespace>/<certificate>"}``).
    """
    common = {"url_base": url_base, "service": service, "ca_bundle": ca_bundle,
              "exclude_namespaces": list(exclude_namespaces)}
    ephemeral = _rule(["UPDATE"], [EPHEMERAL_RESOURCE])
    mutating = _webhook(MUTATE_WEBHOOK, MUTATE_ID, [_rule(["CREATE"], ["pods"]), ephemeral],
                        expression=gpu_pod_expression(update=False), **common)  # type: ignore[arg-type]
    mutating["reinvocationPolicy"] = "IfNeeded"
    # A pod CREATE is validated by the mutating webhook in the same call (handlers.review): one
    # webhook call per new pod. What a mutating webhook after ours changes is checked by the pod
    # policy (podpolicy.pod_policy, CEL in the API server, after every mutating webhook), not
    # by a second call here. Updates still come here.
    validating = _webhook(VALIDATE_WEBHOOK, VALIDATE_ID,
                          [_rule(["UPDATE"], ["pods"]), ephemeral, _rule(["UPDATE"], [STATUS_RESOURCE])],
                          expression=gpu_pod_expression(update=True), **common)  # type: ignore[arg-type]
    validating["matchConditions"].append({"name": "status-changes-kvgpu-metadata",
                                          "expression": status_expression()})
    by_group: dict[str, list[str]] = {}
    for group, plural in sorted(WORKLOADS):
        by_group.setdefault(group, []).append(plural)
    workloads = _webhook(
        WORKLOADS_WEBHOOK, VALIDATE_WORKLOADS_ID,
        [_rule(["CREATE", "UPDATE"], plurals, group) for group, plurals in sorted(by_group.items())],
        expression=gpu_workload_expression(), **common,  # type: ignore[arg-type]
    )
    def meta(name: str) -> dict[str, Any]:
        out: dict[str, Any] = {"name": name, "labels": {"app.kubernetes.io/name": "kvgpu",
                                                        "app.kubernetes.io/component": "admission"}}
        if annotations:
            out["annotations"] = dict(annotations)
        return out

    return (
        {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
         "metadata": meta(MUTATE_NAME), "webhooks": [mutating]},
        {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration",
         "metadata": meta(VALIDATE_NAME), "webhooks": [validating, workloads]},
    )


#: Besides the operator: who else may write VGPUClaims. The garbage collector deletes a claim
#: with its pod (ownerReference), the namespace controller with its namespace; ``system:masters``
#: is the break-glass identity (it bypasses RBAC anyway, and the operator restores a deleted or
#: Released claim of a pod that still runs).
CLAIM_WRITERS_SYSTEM = (
    "system:serviceaccount:kube-system:generic-garbage-collector",
    "system:serviceaccount:kube-system:namespace-controller",
)
CLAIM_WRITER_GROUPS = ("system:masters",)
CLAIM_POLICY_NAME = f"vgpuclaims.{keys.GROUP}"


def _cel_list(items: list[str]) -> str:
    return "[" + ", ".join("'" + i.replace("\\", "\\\\").replace("'", "\\'") + "'" for i in items) + "]"


def claim_policy(operator_usernames: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding)``: only the operator
    (``operator_usernames``) and the system identities above may create, update or delete
    VGPUClaims or their status. Evaluated by the API server itself (no webhook call, no
    dependency on the operator running)."""
    users = sorted({*operator_usernames, *CLAIM_WRITERS_SYSTEM})
    expression = (f"request.userInfo.username in {_cel_list(users)} || "
                  f"(has(request.userInfo.groups) && request.userInfo.groups.exists(g, g in "
                  f"{_cel_list(list(CLAIM_WRITER_GROUPS))}))")
    labels = {"app.kubernetes.io/name": "kvgpu", "app.kubernetes.io/component": "admission"}
    policy = {
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": CLAIM_POLICY_NAME, "labels": dict(labels)},
        "spec": {
            "failurePolicy": "Fail",
            "matchConstraints": {"resourceRules": [{
                "apiGroups": [keys.GROUP], "apiVersions": ["*"], "operations": ["CREATE", "UPDATE", "DELETE"],
                "resources": ["vgpuclaims", "vgpuclaims/status"]}]},
            "validations": [{
                "expression": expression,
                "messageExpression": (
                    "'VGPUClaims are written by the kvgpu operator only (they record the cards a running pod "
                    "holds); ' + request.userInfo.username + ' may read them: kubectl get vgpuclaims'"),
                "reason": "Forbidden",
            }],
        },
    }
    binding = {
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": CLAIM_POLICY_NAME, "labels": dict(labels)},
        "spec": {"policyName": CLAIM_POLICY_NAME, "validationActions": ["Deny"]},
    }
    return policy, binding
