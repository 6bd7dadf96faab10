#!/usr/bin/env python3
"""Write the import graph of the kvgpu package into docs/architecture.md (``make generate``;
tests/unit/test_import_graph.py fails when the section is stale).

Between ``<!-- BEGIN import graph (hack/gen_importgraph.py) -->`` and ``<!-- END import graph -->``:
one row per top-level package or module of ``kvgpu``, in layers (a row imports only rows of
lower layers: the graph has no cycle), naming the ones it imports directly. Built with
grimp, the graph library under import-linter (``make lint``'s contracts check the same graph).

    python hack/gen_importgraph.py           # rewrite the section
    python hack/gen_importgraph.py --check   # exit 1 if it is stale
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
BEGIN = "<!-- BEGIN import graph (hack/gen_importgraph.py) -->"
END = "<!-- END import graph -->"


def package_graph() -> dict[str, set[str]]:
    """Top-level package or module of kvgpu -> the others it imports directly (any module of it)."""
    g = grimp.build_graph("kvgpu")
    out: dict[str, set[str]] = {}
    for m in g.modules:
        parts = m.split(".")
        if len(parts) < 2:
            continue
        out.setdefault(parts[1], set())
        for imported in g.find_modules_directly_imported_by(m):
            other = imported.split(".")
            if len(other) >= 2 and other[0] == "kvgpu" and other[1] != parts[1]:
                out[parts[1]].add(other[1])
    return out


def layers(graph: dict[str, set[str]]) -> list[list[str]]:
    """Longest-path layering: layer 0 imports nothing of kvgpu; a cycle is an error."""
    depth: dict[str, int] = {}

    def visit(n: str, path: tuple[str, ...]) -> int:
        if n in path:
            raise SystemExit(f"import cycle: {' -> '.join((*path, n))}")
        if n not in depth:
            depth[n] = 1 + max((visit(d, (*path, n)) for d in graph[n]), default=-1)
        return depth[n]

    for n in graph:
        visit(n, ())
    out: list[list[str]] = [[] for _ in range(max(depth.values(), default=-1) + 1)]
    for n, d in depth.items():
        out[d].append(n)
    return [sorted(layer) for layer in out]


def render(graph: dict[str, set[str]]) -> str:
    rows = ["| layer | package or module | imports (of kvgpu) |", "|---|---|---|"]
    for i, layer in enumerate(layers(graph)):
        for n in layer:
            deps = ", ".join(f"`{d}`" for d in sorted(graph[n])) or "—"
            rows.append(f"| {i} | `{n}` | {deps} |")
    return "\n".join([BEGIN, *rows, END])


def rewrite(text: str, section: str) -> str:
    start, end = text.index(BEGIN), text.index(END) + len(END)
    return text[:start] + section + text[end:]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the section is stale")
    args = ap.parse_args()
    text = DOC.read_text()
    new = rewrite(text, render(package_graph()))
    if args.check:
        if new != text:
            print(f"{DOC.relative_to(ROOT)}: the import graph is stale; run make generate", file=sys.stderr)
            return 1
        return 0
    if new != text:
        DOC.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
