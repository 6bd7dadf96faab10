"""``docs/api.md``, the API reference: :func:`render_docs`, from the same schemas as the CRDs
(:mod:`kvgpu.api.crdschema`) and the request keys (:mod:`kvgpu.api.request_keys`); written by
:mod:`kvgpu.api.crdgen`."""

from __future__ import annotations

from typing import Any

from kvgpu.api import requests as rq
from kvgpu.api.crdschema import (
    crds,
)
from kvgpu.api.models import (
    VGPUClaim,
    VGPUPool,
)
from kvgpu.api.quotas import RESOURCE_QUOTA_KEYS, VGPUQuota
from kvgpu.core.keys import GROUP, VERSION


def _type_of(s: dict[str, Any]) -> str:
    t = s.get("type", "")
    if t == "array":
        return f"[]{_type_of(s.get('items', {}))}"
    if t == "object" and "additionalProperties" in s:
        return f"map[string]{_type_of(s['additionalProperties'])}"
    if t == "number":
        return "number"
    return str(t)


def _range(s: dict[str, Any]) -> str:
    parts: list[str] = []
    if "enum" in s:
        parts.append(" | ".join(f"`{v}`" for v in s["enum"]))
    lo, hi = s.get("minimum"), s.get("maximum")
    if lo is not None or hi is not None:
        lo_s = "" if lo is None else (f"> {lo}" if s.get("exclusiveMinimum") else f"≥ {lo}")
        hi_s = "" if hi is None else f"≤ {hi}"
        parts.append(", ".join(p for p in (lo_s, hi_s) if p))
    if "minLength" in s or "maxLength" in s:
        parts.append(_span(s.get("minLength"), s.get("maxLength"), "chars"))
    if "minItems" in s or "maxItems" in s:
        parts.append(_span(s.get("minItems"), s.get("maxItems"), "items"))
    if "maxProperties" in s:
        parts.append(f"≤ {s['maxProperties']} entries")
    if "pattern" in s:
        parts.append(f"pattern `{s['pattern']}`")
    if s.get("format"):
        parts.append(s["format"])
    items = s.get("items")
    if isinstance(items, dict) and items.get("type") != "object":
        inner = _range(items)
        if inner:
            parts.append(f"each: {inner}")
    return "; ".join(parts)


def _span(lo: int | None, hi: int | None, unit: str) -> str:
    if lo and hi is not None:
        return f"{lo}-{hi} {unit}"
    if lo:
        return f"≥ {lo} {unit}"
    return f"≤ {hi} {unit}"


def _cell(text: Any) -> str:
    return str(text).replace("\n", " ").replace("|", "\\|")


def _default(s: dict[str, Any]) -> str:
    if "default" not in s:
        return ""
    d = s["default"]
    if d == {} or d == []:
        return ""
    if d == "":
        return '`""`'
    if isinstance(d, bool):
        return f"`{str(d).lower()}`"
    return f"`{d}`"


def _rows(s: dict[str, Any], path: str, required: bool, rows: list[str], rules: list[str]) -> None:
    for r in s.get("x-kubernetes-validations", []):
        rules.append(f"- `{path or '.'}`: {r['message']} (CEL `{r['rule']}`)")
    if path:
        desc = _cell(s.get("description", ""))
        if required:
            desc = ("**required.** " + desc).strip()
        rows.append(f"| `{path}` | {_type_of(s)} | {_default(s)} | {_cell(_range(s))} | {desc} |")
    req = set(s.get("required", []))
    for name, sub in s.get("properties", {}).items():
        _rows(sub, f"{path}.{name}" if path else name, name in req, rows, rules)
    items = s.get("items")
    if isinstance(items, dict) and items.get("type") == "object":
        _rows(items, f"{path}[]", False, rows, rules)


def _table(title: str, schema: dict[str, Any], prefix: str) -> str:
    rows: list[str] = []
    rules: list[str] = []
    _rows(schema, "", False, rows, rules)
    rows = [r.replace("| `", f"| `{prefix}.", 1) for r in rows]
    rules = [
        r.replace("- `.`", f"- `{prefix}`").replace("- `", f"- `{prefix}.", 1)
        if not r.startswith("- `.`")
        else r.replace("- `.`", f"- `{prefix}`")
        for r in rules
    ]
    out = [f"### {title}", "", _cell(schema.get("description", "")), ""]
    out += ["| field | type | default | allowed | description |", "|---|---|---|---|---|", *rows, ""]
    if rules:
        out += ["Rules checked by the API server:", "", *rules, ""]
    return "\n".join(out)


def _columns(cols: list[dict[str, Any]]) -> str:
    out = ["| column | from | shown |", "|---|---|---|"]
    for c in cols:
        out.append(
            f"| {c['name'].upper()} | `{c['jsonPath']}` | {'`-o wide`' if c.get('priority') else 'always'} |"
        )
    return "\n".join(out)


def _keys_table(keys: tuple[rq.KeyDoc, ...]) -> str:
    out = ["| key | where | value | meaning |", "|---|---|---|---|"]
    for k in keys:
        out.append(f"| `{k.key}` | {k.where} | {_cell(k.form)} | {_cell(k.meaning)} |")
    return "\n".join(out)


def render_docs() -> str:
    """The text of docs/api.md."""
    c = crds()
    pool = c[f"{GROUP}_vgpupools.yaml"]["spec"]
    claim = c[f"{GROUP}_vgpuclaims.yaml"]["spec"]
    ps = pool["versions"][0]["schema"]["openAPIV3Schema"]["properties"]
    cs = claim["versions"][0]["schema"]["openAPIV3Schema"]["properties"]
    quota = c[f"{GROUP}_vgpuquotas.yaml"]["spec"]
    qs = quota["versions"][0]["schema"]["openAPIV3Schema"]["properties"]
    parts = [
        "<!-- Generated by `make crds` (python -m kvgpu.api.crdgen) from operator/kvgpu/api. Do not edit -->",
        "# kvgpu API reference",
        "",
        f"Group `{GROUP}`, version `{VERSION}`. Memory is in MiB, cores in percent of a card's SMs. "
        "The CRDs in `charts/kvgpu/crds/` come from the same models as this page.",
        "",
        "## VGPUPool",
        "",
        f"Scope: {pool['scope']}. Short names: {', '.join(pool['names']['shortNames'])}. "
        f"Category: {', '.join(pool['names']['categories'])}.",
        "",
        (VGPUPool.__doc__ or "").strip(),
        "",
        "Which pool covers a card: the pools whose `nodeSelector` matches the node and whose `devices` "
        "filter "
        "matches the card; of those the most specific wins (a UUID filter beats an index filter, which beats "
        "a model filter, which beats none; then more node-selector requirements win). Equally specific pools "
        "conflict: the name that sorts first wins and every pool involved gets the `Conflict` condition. "
        "In `exclusive` mode a card takes one container whatever `splitCount` says. Before a node is chosen "
        "(at admission) the request defaults of the pool named `default` apply, or of the only pool if there "
        "is one, else HAMi's.",
        "",
        "`kubectl get vgpupools`:",
        "",
        _columns(pool["versions"][0]["additionalPrinterColumns"]),
        "",
        _table("VGPUPool spec", ps["spec"], "spec"),
        _table("VGPUPool status", ps["status"], "status"),
        "## VGPUClaim",
        "",
        f"Scope: {claim['scope']}. Short names: {', '.join(claim['names']['shortNames'])}. "
        f"Category: {', '.join(claim['names']['categories'])}.",
        "",
        (VGPUClaim.__doc__ or "").strip() + " Created by the operator at bind time, one per (pod, container) "
        "that got slices, in the pod's namespace, with an owner reference to the pod.",
        "",
        "`kubectl get vgpuclaims`:",
        "",
        _columns(claim["versions"][0]["additionalPrinterColumns"]),
        "",
        _table("VGPUClaim spec", cs["spec"], "spec"),
        _table("VGPUClaim status", cs["status"], "status"),
        "## VGPUQuota",
        "",
        f"Scope: {quota['scope']}. Short names: {', '.join(quota['names']['shortNames'])}. "
        f"Category: {', '.join(quota['names']['categories'])}.",
        "",
        (VGPUQuota.__doc__ or "").strip() + " A pod's usage is, per dimension, the larger of its largest init "
        "container and the sum of its app containers; memory and cores are summed over the cards it got "
        "(HAMi's counting). The same limits can be set with a ResourceQuota: "
        + ", ".join(f"`{k}`" for k in RESOURCE_QUOTA_KEYS) + " (memory, cores, slices; see the user guide "
        "for how this relates to the API server's own counting).",
        "",
        "`kubectl get vgpuquotas` (`kubectl vgpu quota` shows ResourceQuotas too):",
        "",
        _columns(quota["versions"][0]["additionalPrinterColumns"]),
        "",
        _table("VGPUQuota spec", qs["spec"], "spec"),
        _table("VGPUQuota status", qs["status"], "status"),
        "## Requests (pods)",
        "",
        rq.DOC_MARKDOWN,
        "",
        "### kvgpu annotations",
        "",
        _keys_table(rq.ANNOTATION_KEYS),
        "",
        "### HAMi compatibility",
        "",
        _keys_table(rq.HAMI_KEYS),
        "",
        "Where kvgpu differs from HAMi on purpose: `nvidia.com/gpumem: 3Gi` means 3072 MiB (HAMi drops the "
        "request silently); `gpucores` above 100 and both `gpumem` and `gpumem-percentage` are rejected "
        "(HAMi clamps / ignores one); unknown policies are rejected (HAMi falls back to a default); the "
        "exclusive-card rule uses the effective memory after the pool's defaults, and does not apply when "
        "the "
        "pool sets a default gpucores.",
        "",
        "### Messages",
        "",
        "An invalid request is refused with one line per problem, each naming the key, the value and the "
        "allowed form, for example:",
        "",
        "```",
        str(rq.RequestError(rq.GPUMEM, "3Gx", "is not a memory quantity", rq.FORM_MEMORY)),
        str(rq.RequestError(rq.HAMI_GPUCORES, "150", "is out of range", rq.FORM_CORES, "train")),
        "```",
        "",
    ]
    return "\n".join(parts)
