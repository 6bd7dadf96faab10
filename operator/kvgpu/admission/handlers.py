"""Kopf wiring of the admission webhooks (no decisions here: see mutate.py and validate.py).

:func:`register` adds three handlers to a registry (mutate pods, validate pods, validate
workload pod templates); their ids are the URL paths the webhook configurations
(:mod:`kvgpu.admission.config`) point at. Serving is Kopf's webhook server with
``settings.admission.managed = None``: we write our own configurations, because Kopf's managed
ones have no namespaceSelector, matchConditions or reinvocationPolicy and a 30 s timeout.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from typing import Any

import kopf

from kvgpu.admission.mutate import apply_ops, mutate_ephemeral, mutate_pod
from kvgpu.admission.validate import EPHEMERAL, validate_pod, validate_workload

MUTATE_ID = "kvgpu-mutate-pods"
VALIDATE_ID = "kvgpu-validate-pods"
VALIDATE_WORKLOADS_ID = "kvgpu-validate-workloads"

#: (API group, plural) of the workloads whose pod templates are validated.
WORKLOADS: frozenset[tuple[str, str]] = frozenset({
    ("apps", "deployments"), ("apps", "statefulsets"), ("apps", "daemonsets"), ("apps", "replicasets"),
    ("batch", "jobs"), ("batch", "cronjobs"), ("", "replicationcontrollers"), ("", "podtemplates"),
})

#: HTTP status sent with a refusal; the API server shows the message to the user either way.
REFUSAL_CODE = 400

Logger = logging.Logger | logging.LoggerAdapter[Any]


def refusal_message(errors: list[str]) -> str:
    if len(errors) == 1:
        return errors[0]
    return f"{len(errors)} problems: " + "; ".join(f"({i}) {e}" for i, e in enumerate(errors, 1))


def _who(pod: dict[str, Any]) -> str:
    meta = pod.get("metadata") or {}
    return f"pod {meta.get('namespace', '')}/{meta.get('name') or meta.get('generateName', '') + '*'}"


def register(registry: kopf.OperatorRegistry, operator_usernames: Collection[str]) -> None:
    """Register the pod webhooks (mutate, validate) and the workload template webhook
    (validate) on ``registry``.

    ``operator_usernames``: the API usernames of the operator (e.g.
    ``system:serviceaccount:kvgpu-system:kvgpu-operator``); only they may change allocation
    annotations on existing pods.
    """
    operators = frozenset(operator_usernames)

    # subresource="*": the configurations route pods (CREATE) and pods/ephemeralcontainers
    # (UPDATE) here; Kopf would otherwise match the main resource only.
    @kopf.on.mutate("pods", id=MUTATE_ID, operations=["CREATE", "UPDATE"], subresource="*",
                    registry=registry)
    def mutate(
        body: kopf.Body, patch: kopf.Patch, logger: Logger,
        operation: str | None = None, subresource: str | None = None, **_: Any,
    ) -> None:
        pod = dict(body)
        if subresource == EPHEMERAL and operation == "UPDATE":
            ops = mutate_ephemeral(pod)
        elif subresource is None and operation == "CREATE":
            ops = mutate_pod(pod)
        else:
            ops = []
        logger.debug("kvgpu admission: mutate %s %s%s: %d patch ops", operation, _who(pod),
                     f" ({subresource})" if subresource else "", len(ops))
        if not ops:
            return
        # Kopf diffs the body before and after the patch's functions to build the JSON patch.
        def apply(raw: Any) -> None:
            raw.update(apply_ops(raw, ops))

        patch.fns.append(apply)

    @kopf.on.validate("pods", id=VALIDATE_ID, operations=["CREATE", "UPDATE"], subresource="*",
                      registry=registry)
    def validate(
        body: kopf.Body, userinfo: kopf.UserInfo, logger: Logger,
        old: kopf.Body | None = None, operation: str | None = None, subresource: str | None = None,
        **_: Any,
    ) -> None:
        username = str((userinfo or {}).get("username", ""))
        logger.debug("kvgpu admission: validate %s %s%s by %s", operation, _who(dict(body)),
                     f" ({subresource})" if subresource else "", username)
        errors = validate_pod(
            operation or "", dict(body), dict(old) if old is not None else None, username, operators,
            subresource=subresource,
        )
        if errors:
            logger.info("kvgpu: refused %s by %s: %s", operation, username, "; ".join(errors))
            raise kopf.AdmissionError(refusal_message(errors), code=REFUSAL_CODE)

    def is_workload(resource: kopf.Resource) -> bool:
        return (resource.group, resource.plural) in WORKLOADS

    @kopf.on.validate(is_workload, id=VALIDATE_WORKLOADS_ID, operations=["CREATE", "UPDATE"],
                      registry=registry)
    def validate_template(
        body: kopf.Body, resource: kopf.Resource, logger: Logger,
        old: kopf.Body | None = None, operation: str | None = None, **_: Any,
    ) -> None:
        meta = body.get("metadata") or {}
        logger.debug("kvgpu admission: validate %s %s %s/%s", operation, resource.plural,
                     meta.get("namespace", ""), meta.get("name", ""))
        errors = validate_workload(operation or "", dict(body), dict(old) if old is not None else None)
        if errors:
            logger.info("kvgpu: refused %s of %s: %s", operation, resource.plural, "; ".join(errors))
            raise kopf.AdmissionError(refusal_message(errors), code=REFUSAL_CODE)
