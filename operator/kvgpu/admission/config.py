"""Our own Mutating/ValidatingWebhookConfiguration objects (Kopf's managed mode is not used).

Same objects for dev mode (``url_base`` such as ``https://127.0.0.1:9443``, the API server
calls the operator process directly) and production manifests (``service`` reference).

Scope, from the outside in: pods (CREATE; UPDATE for validation) and pods/ephemeralcontainers
(UPDATE, ``kubectl debug``); not in ``kube-system`` nor the excluded namespaces (the
operator's own, so a broken webhook can never block the operator's pod); and, through CEL
``matchConditions`` evaluated by the API server, only pods that mention GPUs at all — a
``kvgpu.io/``, ``nvidia.com/`` or ``hami.io/`` annotation, or a container/init container with an
``nvidia.com/`` limit or request (for UPDATE also a pod that *had* ``kvgpu.io/`` annotations or
the managed label, so removing them is seen). Every other pod never reaches the operator, so
``failurePolicy: Fail`` costs nothing for them and closes the "webhook down ⇒ pod runs
unlimited" hole HAMi has with ``Ignore``.
"""

from __future__ import annotations

import base64
from typing import Any

from kvgpu.admission.handlers import MUTATE_ID, VALIDATE_ID
from kvgpu.admission.mutate import MANAGED_LABEL
from kvgpu.core import keys

MUTATE_NAME = "kvgpu-mutate"
VALIDATE_NAME = "kvgpu-validate"
MUTATE_WEBHOOK = f"pods.mutate.{keys.GROUP}"
VALIDATE_WEBHOOK = f"pods.validate.{keys.GROUP}"
TIMEOUT_S = 5
EPHEMERAL_RESOURCE = "pods/ephemeralcontainers"  # kubectl debug: see mutate.mutate_ephemeral
ALWAYS_EXCLUDED_NAMESPACES = ("kube-system",)

_ANNOTATION_PREFIXES = (f"{keys.GROUP}/", "nvidia.com/", "hami.io/")


def _any_annotation(obj: str, prefixes: tuple[str, ...]) -> str:
    starts = " || ".join(f"k.startsWith('{p}')" for p in prefixes)
    return (f"({obj} != null && has({obj}.metadata.annotations) && "
            f"{obj}.metadata.annotations.exists(k, {starts}))")


def _any_container_resource(field: str) -> str:
    def in_map(m: str) -> str:
        return f"(has(c.resources.{m}) && c.resources.{m}.exists(r, r.startsWith('nvidia.com/')))"

    return (f"(has(object.spec.{field}) && object.spec.{field}.exists(c, has(c.resources) && "
            f"({in_map('limits')} || {in_map('requests')})))")


def gpu_pod_expression(*, update: bool) -> str:
    """CEL: true for pods that mention GPUs (and, with ``update``, pods that were kvgpu pods)."""
    parts = [
        _any_annotation("object", _ANNOTATION_PREFIXES),
        _any_container_resource("containers"),
        _any_container_resource("initContainers"),
    ]
    if update:
        parts.append(_any_annotation("oldObject", (f"{keys.GROUP}/",)))
        parts.append(f"(oldObject != null && has(oldObject.metadata.labels) && "
                     f"'{MANAGED_LABEL}' in oldObject.metadata.labels)")
    return " || ".join(parts)


def _client_config(
    path: str, url_base: str | None, service: tuple[str, str, int] | None, ca_bundle: bytes,
) -> dict[str, Any]:
    if (url_base is None) == (service is None):
        raise ValueError("give exactly one of url_base and service")
    cfg: dict[str, Any] = {"caBundle": base64.b64encode(ca_bundle).decode()}
    if url_base is not None:
        cfg["url"] = f"{url_base.rstrip('/')}/{path}"
    else:
        assert service is not None
        ns, name, port = service
        cfg["service"] = {"namespace": ns, "name": name, "port": int(port), "path": f"/{path}"}
    return cfg


def _rule(operations: list[str], resources: list[str]) -> dict[str, Any]:
    return {"apiGroups": [""], "apiVersions": ["v1"], "operations": operations, "resources": resources,
            "scope": "Namespaced"}


def _webhook(
    name: str, path: str, rules: list[dict[str, Any]], *, update: bool, url_base: str | None,
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
        "matchConditions": [{"name": "mentions-gpus", "expression": gpu_pod_expression(update=update)}],
    }


def webhook_configurations(
    *,
    url_base: str | None,
    service: tuple[str, str, int] | None,
    ca_bundle: bytes,
    exclude_namespaces: list[str],
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Return ``(MutatingWebhookConfiguration, ValidatingWebhookConfiguration)`` dicts.

    ``url_base``: the operator's webhook server as the API server reaches it (dev mode);
    ``service``: ``(namespace, name, port)`` of its Service (production). Exactly one of the two.
    ``ca_bundle``: PEM of the CA that signed the server certificate.
    """
    common = {"url_base": url_base, "service": service, "ca_bundle": ca_bundle,
              "exclude_namespaces": list(exclude_namespaces)}
    ephemeral = _rule(["UPDATE"], [EPHEMERAL_RESOURCE])
    mutating = _webhook(MUTATE_WEBHOOK, MUTATE_ID, [_rule(["CREATE"], ["pods"]), ephemeral],
                        update=False, **common)  # type: ignore[arg-type]
    mutating["reinvocationPolicy"] = "IfNeeded"
    validating = _webhook(VALIDATE_WEBHOOK, VALIDATE_ID, [_rule(["CREATE", "UPDATE"], ["pods"]), ephemeral],
                          update=True, **common)  # type: ignore[arg-type]
    labels = {"app.kubernetes.io/name": "kvgpu", "app.kubernetes.io/component": "admission"}
    return (
        {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
         "metadata": {"name": MUTATE_NAME, "labels": labels}, "webhooks": [mutating]},
        {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration",
         "metadata": {"name": VALIDATE_NAME, "labels": labels}, "webhooks": [validating]},
    )
