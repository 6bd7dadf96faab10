"""The Helm CLI and the chart for tests: :func:`helm_binary` (hack/helm/build.sh, cached outside
the work tree; ``KVGPU_HELM`` overrides with a path) and :func:`render` (``helm template`` of
charts/kvgpu into parsed objects)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import yaml
from kvgpu.devcluster import incluster

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "kvgpu"
KUBE_VERSION = "1.36.3"  # the control plane the tests run (hack/ktp)


def helm_binary() -> Path:
    """The helm binary (:func:`kvgpu.devcluster.incluster.helm_binary`: ``$KVGPU_HELM``, else the
    cached build of hack/helm/build.sh). Raises ``RuntimeError`` when the build fails."""
    return incluster.helm_binary()


def helm(*args: str, check: bool = True, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run helm with ``args``; stdout/stderr captured as text. ``check``: raise
    ``RuntimeError`` (with helm's stderr) on a non-zero exit."""
    proc = subprocess.run([str(helm_binary()), *args], capture_output=True, text=True, check=False,
                          env={**os.environ, **(env or {})})
    if check and proc.returncode != 0:
        raise RuntimeError(f"helm {' '.join(args)} failed (exit {proc.returncode}):\n{proc.stderr}")
    return proc


def template_args(values: dict[str, Any] | None = None, *, namespace: str = "kvgpu-system",
                  kube_version: str = KUBE_VERSION) -> list[str]:
    """``helm template`` arguments for the chart with ``values`` (a dict, passed as JSON)."""
    args = ["template", "kvgpu", str(CHART), "-n", namespace, "--kube-version", kube_version]
    for k, v in (values or {}).items():
        args += ["--set-json", f"{k}={json.dumps(v)}"]
    return args


def render(values: dict[str, Any] | None = None, *, namespace: str = "kvgpu-system",
           kube_version: str = KUBE_VERSION, include_crds: bool = False) -> list[dict[str, Any]]:
    """The chart's objects for ``values`` (top-level key -> value, e.g. ``{"certManager":
    {"enabled": True}}``), as ``helm template`` renders them."""
    args = template_args(values, namespace=namespace, kube_version=kube_version)
    if include_crds:
        args.append("--include-crds")
    out = helm(*args).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def one(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    """The object of ``kind`` named ``name`` (exactly one; ``ValueError`` otherwise)."""
    [d] = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return d
