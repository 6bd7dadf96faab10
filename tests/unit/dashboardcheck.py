"""Check a Grafana dashboard's PromQL against a scrape: every metric a query selects exists,
every label it matches, groups or matches on is on that metric, every ``{{label}}`` of a legend
is on the query's result. PromQL is parsed with ``promql_parser`` (the Rust ``promql-parser``
crate's Python binding); Grafana's ``$__rate_interval`` is replaced by ``5m`` first.

``Scrape``: sample name -> ``[(labels, value)]`` (see :func:`exportedmetrics.scrape`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import promql_parser as pp

Scrape = dict[str, list[tuple[dict[str, str], float]]]
_GRAFANA_RANGES = ("$__rate_interval", "$__interval", "$__range")
_LABEL_VALUES = re.compile(r"^\s*label_values\((?P<sel>.+),\s*(?P<label>[A-Za-z_][A-Za-z0-9_]*)\s*\)\s*$")
_LEGEND = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")


def queries(dashboard: dict[str, Any]) -> Iterator[tuple[str, str, str]]:
    """``(where, expr, legendFormat)`` of every panel target (rows' nested panels too) and every
    query variable (``label_values(...)``: legend empty)."""
    def walk(panels: list[dict[str, Any]]) -> Iterator[tuple[str, str, str]]:
        for p in panels:
            for t in p.get("targets") or []:
                yield f"panel {p.get('title')!r} {t.get('refId')}", str(t["expr"]), str(t.get("legendFormat") or "")
            yield from walk(p.get("panels") or [])

    yield from walk(dashboard.get("panels") or [])
    for v in (dashboard.get("templating") or {}).get("list") or []:
        if v.get("type") == "query":
            q = v["query"]["query"] if isinstance(v.get("query"), dict) else str(v.get("query"))
            yield f"variable {v.get('name')!r}", q, ""


def load(path: Path) -> dict[str, Any]:
    return dict(json.loads(path.read_text()))


class Checker:
    """Errors of queries against one scrape (``check`` returns them as sentences)."""

    def __init__(self, scrape: Scrape) -> None:
        self.scrape = scrape

    def check(self, expr: str, legend: str = "") -> list[str]:
        m = _LABEL_VALUES.match(expr)
        if m:
            expr, need = m.group("sel"), {m.group("label")}
        else:
            need = set()
        for r in _GRAFANA_RANGES:
            expr = expr.replace(r, "5m")
        try:
            ast = pp.parse(expr)
        except ValueError as e:
            return [f"does not parse: {e}"]
        errors: list[str] = []
        out = self._labels(ast, errors)
        need |= set(_LEGEND.findall(legend))
        if out is not None and (missing := need - out):
            errors.append(f"labels {sorted(missing)} not on the result (it has {sorted(out)})")
        return errors

    # ----- the walk: the label names every series of a subexpression has (None: a scalar)
    def _labels(self, node: Any, errors: list[str]) -> set[str] | None:
        kind = type(node).__name__
        if kind == "VectorSelector":
            return self._selector(node, errors)
        if kind == "MatrixSelector":
            return self._selector(node.vector_selector, errors)
        if kind in ("ParenExpr", "UnaryExpr", "SubqueryExpr"):
            return self._labels(node.expr, errors)
        if kind == "Call":
            got = [self._labels(a, errors) for a in node.args if not isinstance(a, str | int | float)]
            vectors = [g for g in got if g is not None]
            return vectors[0] if vectors else None
        if kind == "AggregateExpr":
            return self._aggregate(node, errors)
        if kind == "BinaryExpr":
            return self._binary(node, errors)
        return None  # NumberLiteral, StringLiteral

    def _selector(self, vs: Any, errors: list[str]) -> set[str]:
        name = vs.name
        samples = self.scrape.get(name or "")
        if not samples:
            errors.append(f"metric {name!r} is not exported")
            return set()
        have = set.intersection(*(set(lv) for lv, _ in samples))
        for mt in vs.matchers.matchers:
            if mt.name == "__name__":
                continue
            if not any(mt.name in lv for lv, _ in samples):
                errors.append(f"{name}: no label {mt.name!r} (it has {sorted(have)})")
            elif str(mt.op).endswith(".Equal") and not any(lv.get(mt.name) == mt.value for lv, _ in samples):
                errors.append(f"{name}: no series with {mt.name}={mt.value!r}")
        return have

    def _aggregate(self, node: Any, errors: list[str]) -> set[str]:
        inner = self._labels(node.expr, errors) or set()
        mod = node.modifier
        if mod is None:
            return set() if str(node.op) not in ("topk", "bottomk") else inner
        names = set(mod.labels)
        if str(mod.type).endswith("Without"):
            return inner - names
        if missing := names - inner:
            errors.append(f"{node.op} by {sorted(missing)}: not labels of its input ({sorted(inner)})")
        return names

    def _binary(self, node: Any, errors: list[str]) -> set[str] | None:
        lhs, rhs = self._labels(node.lhs, errors), self._labels(node.rhs, errors)
        if lhs is None or rhs is None:
            return rhs if lhs is None else lhs
        mod = node.modifier
        matching = mod.matching if mod is not None else None
        if matching is not None and str(matching.type).endswith("Include"):
            for side, have in (("left", lhs), ("right", rhs)):
                if missing := set(matching.labels) - have:
                    errors.append(f"on {sorted(missing)}: not labels of the {side} side ({sorted(have)})")
        group = set(mod.group_labels or []) if mod is not None else set()
        card = str(mod.card) if mod is not None else ""
        if card.endswith("ManyToOne"):  # group_left: labels copied from the right
            if missing := group - rhs:
                errors.append(f"group_left {sorted(missing)}: not labels of the right side")
            return lhs | group
        if card.endswith("OneToMany"):
            if missing := group - lhs:
                errors.append(f"group_right {sorted(missing)}: not labels of the left side")
            return rhs | group
        set_op = str(node.op) in ("and", "unless", "or")
        if matching is not None and str(matching.type).endswith("Include") and not set_op:
            return set(matching.labels)
        return lhs if str(node.op) != "or" else lhs & rhs
