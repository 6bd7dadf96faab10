"""The admission decisions per webhook, on AdmissionReview requests (pure; no I/O).

:func:`review` maps a webhook id (the URL path the configurations in
:mod:`kvgpu.admission.config` point at) and the review's ``request`` to a :class:`Decision`:
mutate pods (JSON-patch ops from :mod:`kvgpu.admission.mutate`; at CREATE the same call also
makes every CREATE check of :mod:`kvgpu.admission.validate` on the mutated pod, so a new pod
costs one webhook call), validate pod updates (and, for a configuration that still sends them,
creates) and validate workload pod templates (:mod:`kvgpu.admission.validate`). Served by
:mod:`kvgpu.admission.server` (HTTPS, worker processes). Every call is logged at DEBUG on
``kvgpu.admission`` ("kvgpu admission: mutate CREATE pod ns/name: 3 patch ops"), refusals at INFO.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from kvgpu.admission.mutate import admitted_ops, apply_ops, mutate_ephemeral, mutate_pod
from kvgpu.admission.validate import EPHEMERAL, validate_pod, validate_workload
from kvgpu.admission.warn import pod_warnings, workload_warnings
from kvgpu.api.pools import SliceMinimum

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

log = logging.getLogger("kvgpu.admission")


@dataclass(frozen=True)
class Decision:
    """``allowed``; for a mutation the JSON-patch ``patch`` ops (RFC 6902, ``add`` only); for a
    refusal the ``message`` the user sees and the HTTP-style ``code``; ``warnings`` for the
    AdmissionReview's ``response.warnings`` (kubectl prints each as ``Warning: ...``)."""

    allowed: bool = True
    patch: list[dict[str, Any]] = field(default_factory=list)
    message: str = ""
    code: int = REFUSAL_CODE
    warnings: list[str] = field(default_factory=list)


def refusal_message(errors: list[str]) -> str:
    if len(errors) == 1:
        return errors[0]
    return f"{len(errors)} problems: " + "; ".join(f"({i}) {e}" for i, e in enumerate(errors, 1))


def _who(pod: dict[str, Any]) -> str:
    meta = pod.get("metadata") or {}
    return f"pod {meta.get('namespace', '')}/{meta.get('name') or meta.get('generateName', '') + '*'}"


def _mutate_and_validate(request: dict[str, Any], obj: dict[str, Any], operator_usernames: Collection[str],
                         slice_minimum: SliceMinimum | None) -> Decision:
    """A pod CREATE in one webhook call: the injection, then every check the validating webhook
    makes at CREATE, on the pod as the injection leaves it (so our own entries are recognised
    and anything else under a reserved name is refused); then the admission marker
    (:func:`kvgpu.admission.mutate.admitted_ops`). The webhook is reinvoked
    (``reinvocationPolicy: IfNeeded``) when a later mutating webhook changes the pod, so the
    checks also see what those added; what a webhook changes after our last call is checked by
    the pod policy (:mod:`kvgpu.admission.podpolicy`) in the API server."""
    ops = mutate_pod(obj)
    mutated = apply_ops(obj, ops) if ops else obj
    username = str((request.get("userInfo") or {}).get("username", ""))
    errors = validate_pod("CREATE", mutated, None, username, frozenset(operator_usernames),
                          min_slice=slice_minimum)
    log.debug("kvgpu admission: mutate CREATE %s: %d patch ops", _who(obj), len(ops))
    if errors:
        log.info("kvgpu: refused CREATE by %s: %s", username, "; ".join(errors))
        return Decision(False, message=refusal_message(errors))
    ops += admitted_ops(mutated)
    return Decision(patch=ops, warnings=pod_warnings("CREATE", mutated, None))


def review(webhook: str, request: dict[str, Any], operator_usernames: Collection[str],
           slice_minimum: SliceMinimum | None = None) -> Decision:
    """The decision of webhook ``webhook`` (an id above) on an AdmissionReview ``request``.

    ``operator_usernames``: the API usernames of the operator (e.g.
    ``system:serviceaccount:kvgpu-system:kvgpu-operator``); only they may change allocation
    annotations on existing pods. ``slice_minimum``: the smallest ``gpumem`` admitted
    (:func:`kvgpu.api.pools.slice_minimum` of the cluster's pools; None: kvgpu's default).
    Raises ``KeyError`` for an unknown webhook id."""
    operation = str(request.get("operation") or "")
    subresource = request.get("subResource") or None
    obj = request.get("object") or {}
    old = request.get("oldObject") or None
    if webhook == MUTATE_ID:
        if subresource == EPHEMERAL and operation == "UPDATE":
            ops = mutate_ephemeral(obj)
        elif subresource is None and operation == "CREATE":
            return _mutate_and_validate(request, obj, operator_usernames, slice_minimum)
        else:
            ops = []
        log.debug("kvgpu admission: mutate %s %s%s: %d patch ops", operation, _who(obj),
                  f" ({subresource})" if subresource else "", len(ops))
        return Decision(patch=ops)
    if webhook == VALIDATE_ID:
        username = str((request.get("userInfo") or {}).get("username", ""))
        log.debug("kvgpu admission: validate %s %s%s by %s", operation, _who(obj),
                  f" ({subresource})" if subresource else "", username)
        errors = validate_pod(operation, obj, old, username, frozenset(operator_usernames), subresource=subresource,
                              min_slice=slice_minimum)
        if errors:
            log.info("kvgpu: refused %s by %s: %s", operation, username, "; ".join(errors))
            return Decision(False, message=refusal_message(errors))
        return Decision(warnings=pod_warnings(operation, obj, subresource))
    if webhook == VALIDATE_WORKLOADS_ID:
        res = request.get("resource") or {}
        plural = str(res.get("resource", ""))
        meta = obj.get("metadata") or {}
        log.debug("kvgpu admission: validate %s %s %s/%s", operation, plural, meta.get("namespace", ""),
                  meta.get("name", ""))
        if (str(res.get("group", "")), plural) not in WORKLOADS:
            return Decision()
        errors = validate_workload(operation, obj, old, min_slice=slice_minimum)
        if errors:
            log.info("kvgpu: refused %s of %s: %s", operation, plural, "; ".join(errors))
            return Decision(False, message=refusal_message(errors))
        return Decision(warnings=workload_warnings(operation, obj, old))
    raise KeyError(webhook)
