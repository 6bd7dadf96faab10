"""OperatorState is changed only through its methods: no module of the operator assigns one of
its fields, or mutates one of its dicts and sets in place, from outside kvgpu.reconcile.state.
(Reading the fields is fine; the ledger and the quota book are changed through their own
methods.)"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import kvgpu
from kvgpu.reconcile.state import OperatorState

ROOT = Path(kvgpu.__file__).parent
FIELDS = {f.name for f in dataclasses.fields(OperatorState)}
MUTATORS = {"pop", "popitem", "add", "update", "clear", "discard", "setdefault", "remove", "append",
            "extend", "insert", "difference_update", "intersection_update", "symmetric_difference_update"}


def _is_state(node: ast.AST) -> bool:
    """``state``, ``st`` or ``<anything>.state``."""
    return (isinstance(node, ast.Name) and node.id in ("state", "st")) or (
        isinstance(node, ast.Attribute) and node.attr == "state")


def _field(node: ast.AST) -> str | None:
    """The OperatorState field that ``node`` (or the container it indexes) names, if any."""
    while isinstance(node, ast.Subscript):
        node = node.value
    if isinstance(node, ast.Attribute) and node.attr in FIELDS and _is_state(node.value):
        return node.attr
    return None


def writes(tree: ast.AST) -> list[tuple[int, str]]:
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        targets: list[ast.AST] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = list(node.targets)
        for t in targets:
            for sub in ast.walk(t):
                if (isinstance(sub, ast.Attribute | ast.Subscript) and isinstance(sub.ctx, ast.Store | ast.Del)
                        and (name := _field(sub)) is not None):
                    out.append((node.lineno, name))
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in MUTATORS and (name := _field(node.func.value)) is not None
                and name not in ("ledger", "quotas")):
            out.append((node.lineno, f"{name}.{node.func.attr}()"))
    return out


def test_the_guard_sees_the_writes_it_forbids() -> None:
    src = ("self.state.ready = True\nself.state.claim_uids[k] = u\nst.pending.pop(u, None)\n"
           "self.state.dirty_nodes |= x\ndel self.state.conflict_notes[n]\n"
           "self.state.ledger.reserve(k, a)\nx = self.state.claim_uids.get(k)\n")
    assert sorted(writes(ast.parse(src))) == [
        (1, "ready"), (2, "claim_uids"), (3, "pending.pop()"), (4, "dirty_nodes"), (5, "conflict_notes")]


def test_operator_state_is_changed_only_through_its_methods() -> None:
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        if path.relative_to(ROOT).as_posix() == "reconcile/state.py":
            continue
        found += [f"{path.relative_to(ROOT)}:{line}: {name}" for line, name in writes(ast.parse(path.read_text()))]
    assert found == []
