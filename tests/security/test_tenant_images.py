"""Tenant images people really run: a non-root user (uid 1000, ``runAsNonRoot``,
``readOnlyRootFilesystem``, as Jupyter and vLLM images do), by the pod spec or by the image's
own ``USER``. The container's region directory must be writable by that user, so the shim can
create its region and CUDA works under the claim (it is refused otherwise: fail closed)."""

from __future__ import annotations

import json

import pytest
from realnode.gpupods import container, exec_in, gpu_pod, hami_limits
from security.conftest import RealPods

MIB = 1 << 20


def _nonroot_pod(rp: RealPods, name: str, by_spec: bool) -> dict:
    c = container("main", hami_limits(1, 1000), image="kvgpu.local/tenant-nonroot:1")
    c["securityContext"] = {"runAsNonRoot": True, "readOnlyRootFilesystem": True, "allowPrivilegeEscalation": False}
    if by_spec:
        c["securityContext"].update(runAsUser=1000, runAsGroup=1000)
    return gpu_pod(rp, name, containers=[c])


@pytest.mark.parametrize("by_spec", [True, False], ids=["runAsUser-in-spec", "USER-of-the-image"])
def test_non_root_tenant_runs_cuda_under_its_claim(real_pods: RealPods, by_spec: bool) -> None:
    real_pods.apply(_nonroot_pod(real_pods, "nb", by_spec))
    real_pods.wait_running("nb", timeout=90)
    assert exec_in(real_pods, "nb", "main", "id -u").strip() == "1000"
    assert "Read-only file system" in exec_in(real_pods, "nb", "main", "touch /x 2>&1; true")
    info = json.loads(exec_in(real_pods, "nb", "main", "cuprog info").splitlines()[0])
    assert info["rc"] == 0 and info["total"] == 1000 * MIB, info
    fill = json.loads(exec_in(real_pods, "nb", "main", f"cuprog fill alloc {128 * MIB}").splitlines()[0])
    assert fill["rc"] == 2 and fill["bytes"] <= 1000 * MIB, fill  # the limit holds for the tenant's user
    assert "vgpu.region" in exec_in(real_pods, "nb", "main", "ls $KVGPU_REGION_DIR")
