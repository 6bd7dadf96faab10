"""The real node's stand-in for the NVIDIA runtime (kvgpu.devcluster.runtimeplugin) and the MPS
daemons' owner pod bench/gpu/realnode_mps.py runs with it: the chart's kvgpu-mps container."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

from kvgpu.devcluster.runtimeplugin import RESOURCE, runtime_device_specs

from tests.helmkit import one, render

ROOT = Path(__file__).resolve().parents[2]


def test_every_card_and_control_node_no_caps(tmp_path: Path) -> None:
    for n in ("nvidia10", "nvidia1", "nvidia0", "nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-x"):
        (tmp_path / n).touch()
    (tmp_path / "nvidia-caps").mkdir()
    specs = runtime_device_specs(tmp_path)
    assert [s.container_path for s in specs] == ["/dev/nvidia0", "/dev/nvidia1", "/dev/nvidia10", "/dev/nvidiactl",
                                                 "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"]
    assert {s.permissions for s in specs} == {"rw"} and specs[0].host_path == str(tmp_path / "nvidia0")


def _realnode_mps(monkeypatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(ROOT / "bench" / "gpu"))  # its sibling realnode_kit
    monkeypatch.delitem(sys.modules, "realnode_kit", raising=False)
    spec = importlib.util.spec_from_file_location("realnode_mps", ROOT / "bench" / "gpu" / "realnode_mps.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class _Node:
    name = "h200-node"


def test_the_realnode_mps_owner_runs_the_charts_container(monkeypatch) -> None:
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT / "operator"), os.environ.get("PYTHONPATH", "")]))
    rr = _realnode_mps(monkeypatch)
    pod = rr.mps_owner_pod(_Node())
    [c] = pod["spec"]["containers"]
    [chart] = one(render(), "DaemonSet", "kvgpu-mps")["spec"]["template"]["spec"]["containers"]
    assert c["securityContext"] == chart["securityContext"]
    assert c["args"] == chart["args"]
    env = {e["name"]: e["value"] for e in c["env"]}
    assert all(env[e["name"]] == e["value"] for e in chart["env"] if e["name"].startswith("NVIDIA_"))
    assert [m["mountPath"] for m in chart["volumeMounts"]] == [m["mountPath"] for m in c["volumeMounts"]
                                                               if not m.get("readOnly")]
    assert pod["spec"]["automountServiceAccountToken"] is False
    assert c["resources"]["limits"] == {RESOURCE: 1}  # the cards and driver, as the runtime gives them
    # kvgpu's modules are importable in the pod: each folder they come from is mounted
    mounted = {v["hostPath"]["path"] for v in pod["spec"]["volumes"]}
    assert str((ROOT / "operator").resolve()) in mounted
