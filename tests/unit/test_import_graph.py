"""docs/architecture.md's import graph is the code's (hack/gen_importgraph.py, make generate)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def _gen() -> Any:
    spec = importlib.util.spec_from_file_location("gen_importgraph", ROOT / "hack" / "gen_importgraph.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_documented_import_graph_is_current() -> None:
    gen = _gen()
    text = gen.DOC.read_text()
    assert gen.rewrite(text, gen.render(gen.package_graph())) == text, "run make generate"


def test_the_layers_put_every_import_below_its_importer() -> None:
    gen = _gen()
    graph = gen.package_graph()
    layer = {n: i for i, names in enumerate(gen.layers(graph)) for n in names}
    assert {"core", "api", "allocator", "runtime", "cli"} <= set(layer)
    assert all(layer[d] < layer[n] for n, deps in graph.items() for d in deps)
    assert not graph["core"] and layer["core"] == 0
