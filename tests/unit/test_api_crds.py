"""Generated files: no drift, structural schemas, printer columns, and the examples."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from kvgpu.api import crdgen
from kvgpu.api.models import VGPUPool
from kvgpu.api.requests import parse_pod, validate_pod
from pydantic import ValidationError

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def test_generated_files_do_not_drift() -> None:
    """`make crds` output equals the committed files (run `make crds` after changing the models)."""
    for rel, text in crdgen.render().items():
        path = ROOT / rel
        assert path.exists(), f"{rel} missing: run `make crds`"
        assert path.read_text() == text, f"{rel} is out of date: run `make crds`"


def test_check_mode(tmp_path: Path) -> None:
    assert crdgen.main([str(tmp_path), "--check"]) == 1
    assert crdgen.main([str(tmp_path)]) == 0
    assert crdgen.main([str(tmp_path), "--check"]) == 0


def _walk(node: Any, path: str = "") -> list[tuple[str, dict[str, Any]]]:
    out: list[tuple[str, dict[str, Any]]] = []
    if isinstance(node, dict):
        out.append((path, node))
        for k, v in node.get("properties", {}).items():
            out += _walk(v, f"{path}.{k}")
        if isinstance(node.get("items"), dict):
            out += _walk(node["items"], f"{path}[]")
        if isinstance(node.get("additionalProperties"), dict):
            out += _walk(node["additionalProperties"], f"{path}{{}}")
    return out


@pytest.mark.parametrize("name", sorted(crdgen.crds()))
def test_structural_schema(name: str) -> None:
    crd = crdgen.crds()[name]
    (version,) = crd["spec"]["versions"]
    assert version["storage"] and version["served"] and version["subresources"] == {"status": {}}
    schema = version["schema"]["openAPIV3Schema"]
    for path, node in _walk(schema):
        assert "type" in node, f"{path} has no type"
        for bad in ("$ref", "$defs", "anyOf", "allOf", "oneOf", "title", "readOnly", "const"):
            assert bad not in node, f"{path} has {bad}"
        assert not ("properties" in node and "additionalProperties" in node), path
        assert node.get("default", 0) is not None, f"{path} has a null default"
        if "exclusiveMinimum" in node:
            assert node["exclusiveMinimum"] is True and "minimum" in node, path
        if node["type"] == "array":
            assert "maxItems" in node, f"{path}: unbounded list"


def test_names_and_columns() -> None:
    pool = crdgen.crds()["kvgpu.io_vgpupools.yaml"]["spec"]
    claim = crdgen.crds()["kvgpu.io_vgpuclaims.yaml"]["spec"]
    assert pool["scope"] == "Cluster" and claim["scope"] == "Namespaced"
    assert "vgp" in pool["names"]["shortNames"] and "vgc" in claim["names"]["shortNames"]

    def shown(spec: dict[str, Any]) -> list[str]:
        return [
            c["name"].upper()
            for c in spec["versions"][0]["additionalPrinterColumns"]
            if not c.get("priority")
        ]

    assert shown(pool) == ["NODES", "CARDS", "SLOTS", "MEMORY", "AGE"]
    assert shown(claim) == ["POD", "CONTAINER", "NODE", "GPU", "MEMORY", "CORES", "PHASE", "AGE"]


def test_cel_rules_present() -> None:
    text = (ROOT / "charts" / "kvgpu" / "crds" / "kvgpu.io_vgpuclaims.yaml").read_text()
    assert "self == oldSelf" in text and "spec is immutable" in text
    text = (ROOT / "charts" / "kvgpu" / "crds" / "kvgpu.io_vgpupools.yaml").read_text()
    assert "set gpumem or gpumemPercentage, not both" in text


def test_docs_list_every_field_and_key() -> None:
    doc = (ROOT / "docs" / "api.md").read_text()
    for field in (
        "spec.splitCount",
        "spec.memoryScaling",
        "spec.defaults.gpumemPercentage",
        "status.slotsSummary",
        "spec.devices[].memory",
        "status.phase",
    ):
        assert f"`{field}`" in doc, field
    for key in (
        "kvgpu.io/gpumem",
        "kvgpu.io/containers",
        "nvidia.com/gpumem",
        "hami.io/gpu-scheduler-policy",
    ):
        assert f"`{key}`" in doc, key


# --------------------------------------------------------------------------- examples


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _expected(path: Path) -> list[str]:
    return [
        line[len("# expect: ") :] for line in path.read_text().splitlines() if line.startswith("# expect: ")
    ]


VALID = sorted(EXAMPLES.glob("*.yaml"))
INVALID = sorted((EXAMPLES / "invalid").glob("*.yaml"))


def test_examples_exist() -> None:
    names = {p.name for p in VALID}
    assert {
        "pool.yaml",
        "pod-annotations.yaml",
        "pod-hami.yaml",
        "deployment.yaml",
        "pod-init-container.yaml",
    } <= names
    assert len(INVALID) >= 4


@pytest.mark.parametrize("path", VALID, ids=lambda p: p.name)
def test_valid_example(path: Path) -> None:
    for doc in _docs(path):
        if doc["kind"] == "VGPUPool":
            VGPUPool.model_validate(doc)
        else:
            assert validate_pod(doc) == [], path
            assert parse_pod(doc) is not None


def test_seed_pod_both_forms_mean_the_same() -> None:
    a = parse_pod(_docs(EXAMPLES / "pod-annotations.yaml")[0])
    h = parse_pod(_docs(EXAMPLES / "pod-hami.yaml")[0])
    assert a is not None and h is not None
    (ca,), (ch,) = a.containers, h.containers
    assert (ca.cards, ca.memory_mib, ca.cores) == (ch.cards, ch.memory_mib, ch.cores) == (1, 3000, 30)


def test_pool_example_values() -> None:
    p = VGPUPool.model_validate(_docs(EXAMPLES / "pool.yaml")[0])
    assert (p.spec.split_count, p.spec.memory_scaling) == (10, 1.0)


@pytest.mark.parametrize("path", INVALID, ids=lambda p: p.name)
def test_invalid_example(path: Path) -> None:
    expected = _expected(path)
    assert expected, f"{path.name} has no '# expect:' line"
    (doc,) = _docs(path)
    if doc["kind"] == "VGPUPool":
        with pytest.raises(ValidationError):  # the API server's own message is checked in tests/cluster
            VGPUPool.model_validate(doc)
    else:
        assert [str(e) for e in validate_pod(doc)] == expected


def test_example_pools_cover_as_documented() -> None:
    from kvgpu.api.pools import effective_slicing
    from kvgpu.core.inventory import Card

    pools = [VGPUPool.model_validate(d) for p in VALID for d in _docs(p) if d["kind"] == "VGPUPool"]
    h200 = Card(uuid="GPU-1", index=0, model="NVIDIA H200", memory_mib=143771, sm_count=132)
    a100 = Card(uuid="GPU-2", index=1, model="NVIDIA A100-SXM4-80GB", memory_mib=81920, sm_count=108)
    inference = {"kvgpu.io/gpu-node": "true", "pool": "inference"}
    s = effective_slicing(pools, inference, h200)
    assert s is not None and (s.pool, s.split_count, s.memory_scaling) == ("inference-h200", 20, 1.5)
    assert effective_slicing(pools, inference, a100).pool == "default"  # type: ignore[union-attr]
    assert effective_slicing(pools, {"kvgpu.io/gpu-node": "true"}, h200).pool == "default"  # type: ignore[union-attr]
    assert effective_slicing(pools, {}, h200) is None  # not a GPU node
