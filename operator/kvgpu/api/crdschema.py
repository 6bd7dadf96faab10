"""The CRDs (``charts/kvgpu/crds/*.yaml``) as data: :func:`crds`, from :mod:`kvgpu.api.models` and
:mod:`kvgpu.api.quotas`; written by :mod:`kvgpu.api.crdgen`.

Pydantic's JSON schema is turned into a Kubernetes *structural* schema: ``$ref`` inlined,
titles dropped, ``anyOf [X, null]`` collapsed to X, ``additionalProperties: false`` dropped
(unknown fields are pruned by the API server instead), numeric ``exclusiveMinimum`` rewritten to
the OpenAPI v3.0 boolean form, and ``default: {}`` added to optional nested objects so that their
fields' defaults are applied by the API server.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from kvgpu.api.models import (
    VGPUClaim,
    VGPUClaimSpec,
    VGPUClaimStatus,
    VGPUPool,
    VGPUPoolSpec,
    VGPUPoolStatus,
)
from kvgpu.api.quotas import VGPUQuota, VGPUQuotaSpec, VGPUQuotaStatus
from kvgpu.core.keys import GROUP, VERSION

_DROP = {"title", "readOnly", "$defs"}


def _resolve(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, list):
        return [_resolve(x, defs) for x in node]
    if not isinstance(node, dict):
        return node
    node = dict(node)
    if "$ref" in node:
        target = defs[node.pop("$ref").rsplit("/", 1)[-1]]
        merged = dict(target)
        merged.update(node)  # the field's description/default win over the class's
        node = merged
    if "anyOf" in node:
        branches = [b for b in node.pop("anyOf") if b.get("type") != "null"]
        if len(branches) != 1:
            raise ValueError(f"cannot make a structural schema of anyOf {branches}")
        merged = dict(branches[0])
        merged.update(node)
        node = merged
        return _resolve(node, defs)
    if "allOf" in node and len(node["allOf"]) == 1:
        merged = dict(node.pop("allOf")[0])
        merged.update(node)
        return _resolve(merged, defs)
    out: dict[str, Any] = {}
    computed = {
        n for n, sub in node.get("properties", {}).items() if isinstance(sub, dict) and sub.get("readOnly")
    }
    if computed and "required" in node:  # computed fields: written by our models, optional for others
        node["required"] = [n for n in node["required"] if n not in computed]
    for k, v in node.items():
        if k in _DROP:
            continue
        if k == "additionalProperties" and v is False:
            continue
        if k == "properties":
            out[k] = {name: _resolve(sub, defs) for name, sub in v.items()}
        elif k in ("items", "additionalProperties"):
            out[k] = _resolve(v, defs)
        elif k == "default" and v is None:
            continue
        elif k == "required" and not v:
            continue
        elif k == "description" and isinstance(v, str):
            out[k] = v.replace("``", "`")
        else:
            out[k] = v
    if isinstance(out.get("exclusiveMinimum"), (int, float)) and not isinstance(
        out["exclusiveMinimum"], bool
    ):
        out["minimum"] = out.pop("exclusiveMinimum")
        out["exclusiveMinimum"] = True
    if isinstance(out.get("exclusiveMaximum"), (int, float)) and not isinstance(
        out["exclusiveMaximum"], bool
    ):
        out["maximum"] = out.pop("exclusiveMaximum")
        out["exclusiveMaximum"] = True
    if "enum" in out and "type" not in out:
        out["type"] = "string"
    if out.get("type") == "object" and "properties" in out:
        required = set(out.get("required", []))
        for name, sub in out["properties"].items():
            if (
                name not in required
                and sub.get("type") == "object"
                and "properties" in sub
                and "default" not in sub
                and not sub.get("required")  # no valid empty form: absent unless set
            ):
                sub["default"] = {}
    return out


def _order(node: Any) -> Any:
    """Stable key order for readable YAML: type/description first, then the rest, properties last."""
    if isinstance(node, list):
        return [_order(x) for x in node]
    if not isinstance(node, dict):
        return node
    first = [
        "type",
        "description",
        "default",
        "enum",
        "format",
        "pattern",
        "minimum",
        "exclusiveMinimum",
        "maximum",
        "exclusiveMaximum",
        "minLength",
        "maxLength",
        "minItems",
        "maxItems",
        "maxProperties",
    ]
    out: dict[str, Any] = {}
    for k in first:
        if k in node:
            out[k] = node[k]
    for k in sorted(node):
        if k not in out and k not in ("properties", "items", "additionalProperties", "required"):
            out[k] = _order(node[k])
    for k in ("required", "items", "additionalProperties", "properties"):
        if k in node:
            out[k] = {n: _order(s) for n, s in node[k].items()} if k == "properties" else _order(node[k])
    return out


def structural(model: type[BaseModel]) -> dict[str, Any]:
    """The structural OpenAPI v3 schema of a model (serialization view: computed fields included)."""
    raw = model.model_json_schema(by_alias=True, mode="serialization")
    defs = raw.get("$defs", {})
    return _order(_resolve(raw, defs))


def _root(
    spec: type[BaseModel], status: type[BaseModel], description: str, spec_required: bool
) -> dict[str, Any]:
    spec_schema = structural(spec)
    root: dict[str, Any] = {"type": "object", "description": description}
    if spec_required:
        root["required"] = ["spec"]
    else:
        spec_schema["default"] = {}  # every field has a default: `spec: {}` (or none) is a valid object
        spec_schema = _order(spec_schema)
    root["properties"] = {
        "apiVersion": {"type": "string"},
        "kind": {"type": "string"},
        "metadata": {"type": "object"},
        "spec": spec_schema,
        "status": structural(status),
    }
    return root


def _col(name: str, type_: str, path: str, description: str, priority: int = 0) -> dict[str, Any]:
    c: dict[str, Any] = {"name": name, "type": type_, "jsonPath": path, "description": description}
    if priority:
        c["priority"] = priority
    return c


AGE = _col("Age", "date", ".metadata.creationTimestamp", "Time since creation.")

POOL_COLUMNS = [
    _col("Nodes", "integer", ".status.nodes", "Nodes with covered cards."),
    _col("Cards", "integer", ".status.cards", "Covered cards."),
    _col("Slots", "string", ".status.slotsSummary", "Slices used/total."),
    _col("Memory", "string", ".status.memorySummary", "Memory promised/total (virtual)."),
    _col("Mode", "string", ".spec.mode", "Sharing mode.", 1),
    _col("Split", "integer", ".spec.splitCount", "Slices per card.", 1),
    AGE,
]

CLAIM_COLUMNS = [
    _col("Pod", "string", ".spec.podName", "The pod."),
    _col("Container", "string", ".spec.container", "The container."),
    _col("Node", "string", ".spec.node", "The node."),
    _col("GPU", "string", ".spec.gpuSummary", "Card indexes on the node."),
    _col("Memory", "string", ".spec.memorySummary", "Memory per card."),
    _col("Cores", "string", ".spec.coresSummary", "Percent of SMs per card."),
    _col("Phase", "string", ".status.phase", "Released or Failed once the pod ended; empty while the claim "
         "holds its cards (Bound: kubectl vgpu claims shows it)."),
    AGE,
    _col("Pool", "string", ".spec.pool", "The pool.", 1),
    _col("Priority", "integer", ".spec.priority", "0 high, 1 low.", 1),
    _col("ResourceClaim", "string", ".spec.resourceClaim.name", "The DRA ResourceClaim it mirrors (docs/dra.md).", 1),
]

QUOTA_COLUMNS = [
    _col("Memory", "string", ".status.memorySummary", "Memory used/hard, MiB summed over cards."),
    _col("Cores", "string", ".status.coresSummary", "Cores used/hard, percent-of-card units."),
    _col("Cards", "string", ".status.cardsSummary", "Physical cards used/hard."),
    _col("Slices", "string", ".status.slicesSummary", "Slices (container x card) used/hard."),
    AGE,
]


def _crd(
    model: type[BaseModel],
    spec: type[BaseModel],
    status: type[BaseModel],
    short: list[str],
    columns: list[dict[str, Any]],
) -> dict[str, Any]:
    kind: str = model.KIND  # type: ignore[attr-defined]
    plural: str = model.PLURAL  # type: ignore[attr-defined]
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{GROUP}", "labels": {"app.kubernetes.io/part-of": "kvgpu"}},
        "spec": {
            "group": GROUP,
            "names": {
                "kind": kind,
                "listKind": f"{kind}List",
                "plural": plural,
                "singular": kind.lower(),
                "shortNames": short,
                "categories": ["kvgpu"],
            },
            "scope": model.SCOPE,  # type: ignore[attr-defined]
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": columns,
                    "schema": {
                        "openAPIV3Schema": _root(
                            spec, status, (model.__doc__ or "").strip(), spec_required=model is VGPUClaim
                        )
                    },
                }
            ],
        },
    }


def crds() -> dict[str, dict[str, Any]]:
    """``{file name: CRD dict}`` for every kind."""
    return {
        f"{GROUP}_vgpupools.yaml": _crd(
            VGPUPool, VGPUPoolSpec, VGPUPoolStatus, ["vgp", "vgpool"], POOL_COLUMNS
        ),
        f"{GROUP}_vgpuclaims.yaml": _crd(
            VGPUClaim, VGPUClaimSpec, VGPUClaimStatus, ["vgc", "vgclaim"], CLAIM_COLUMNS
        ),
        f"{GROUP}_vgpuquotas.yaml": _crd(
            VGPUQuota, VGPUQuotaSpec, VGPUQuotaStatus, ["vgq", "vgquota"], QUOTA_COLUMNS
        ),
    }
