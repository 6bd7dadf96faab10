"""A hostile tenant's GPU pod tries to replace or read what the device plugin's ``Allocate``
mounts (the shim, ``/etc/ld.so.preload``, its region, the compute schedule, the MPS pipe
folder) with a hostPath of its own, or to pose as kvgpu's volumes by name; each is refused at
admission on the real API server, through the session operator's webhook (issue 15)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from kvgpu.admission import mutate as m

from tests.cluster.conftest import GpuEnv, gpu

__all__ = ["gpu"]

SLICE = {"kvgpu.io/gpumem": "3000"}


def _create(env: GpuEnv, body: dict[str, Any]) -> Any:
    return env.cluster.kubectl("create", "-f", "-", input=json.dumps(body), check=False)


@pytest.mark.parametrize("target", m.DEVICE_PLUGIN_TARGETS)
def test_a_hostpath_onto_an_allocate_target_is_refused(gpu: GpuEnv, target: str) -> None:
    body = gpu.pod("onto-target", SLICE)
    body["spec"]["volumes"] = [{"name": "mine", "hostPath": {"path": "/tmp/tenant-files"}}]
    body["spec"]["containers"][0]["volumeMounts"] = [{"name": "mine", "mountPath": target}]
    p = _create(gpu, body)
    assert p.returncode != 0, p.stdout
    assert f"mounts something else at {target}" in p.stderr and "device plugin mounts it" in p.stderr, p.stderr
    assert not gpu.pods()


@pytest.mark.parametrize("name", [*m.RESERVED_VOLUMES, "kvgpu-claim-main", "kvgpu-claim-other"])
def test_a_volume_under_a_reserved_name_is_refused(gpu: GpuEnv, name: str) -> None:
    body = gpu.pod("reserved-name", SLICE)
    body["spec"]["volumes"] = [{"name": name, "hostPath": {"path": "/tmp/tenant-files"}}]
    body["spec"]["containers"][0]["volumeMounts"] = [{"name": name, "mountPath": "/data"}]
    p = _create(gpu, body)
    assert p.returncode != 0, p.stdout
    assert f"volume name {name!r} is reserved by kvgpu" in p.stderr, p.stderr
    assert not gpu.pods()


def test_a_hostpath_to_kvgpus_host_directories_is_refused(gpu: GpuEnv) -> None:
    body = gpu.pod("host-dirs", SLICE)
    body["spec"]["volumes"] = [{"name": "regions", "hostPath": {"path": "/var/lib/kvgpu/containers"}}]
    body["spec"]["containers"][0]["volumeMounts"] = [{"name": "regions", "mountPath": "/data"}]
    p = _create(gpu, body)
    assert p.returncode != 0 and "'/var/lib/kvgpu/containers'" in p.stderr, p.stderr
    # Control: the same pod with a harmless host path is admitted.
    body["spec"]["volumes"][0]["hostPath"]["path"] = "/opt/datasets"
    ok = _create(gpu, body)
    assert ok.returncode == 0, ok.stderr
