"""The product images (kvgpu.devcluster.productimages, the recipe equivalent to Dockerfile.operator
and Dockerfile.agent) imported into the real node's containerd and run there as pods: entrypoint,
cmd and user as in the Dockerfiles, the CLI, the runtime imports, the agent's shim."""

from __future__ import annotations

import hashlib
import json
import tarfile
import time
from typing import Any

import pytest
from kvgpu.devcluster import productimages
from kvgpu.devcluster.images import REPO_ROOT
from kvgpu.devcluster.realnode import SHIM_SOURCE, RealNode
from realnode.conftest import RealPods

IMPORTS = "import kvgpu, kopf, kubernetes_asyncio, kubernetes, grpc, pynvml, uvloop, cryptography, pydantic; " \
          "from kvgpu.agent.proto import deviceplugin_pb2_grpc, podresources_pb2_grpc; print('imports ok')"
AGENT_FLAGS = ("--shim-source", "--no-device-plugin", "--device-specs", "--dev-root", "--host-dev-root",
               "--driver-root", "--pod-resources-socket", "--metrics-port", "--node")
# as the chart runs them (charts/kvgpu/templates/operator.yaml, agent.yaml)
OPERATOR_POD_SC = {"runAsNonRoot": True, "runAsUser": 65532, "runAsGroup": 65532}
OPERATOR_SC = {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}}
AGENT_SC = {"privileged": False, "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"], "add": ["CHOWN", "KILL"]}}


@pytest.fixture(scope="module")
def product(real_node: RealNode) -> dict[str, str]:
    t = time.monotonic()
    op, ag = real_node.import_product_images()
    print(f"\n[kvgpu] product images {op}, {ag}: built/found and imported in {time.monotonic() - t:.1f} s")
    return {"operator": op, "agent": ag}


def _pod(rp: RealPods, name: str, image: str, *, command: list[str] | None = None, args: list[str] | None = None,
         security: dict[str, Any] | None = None, pod_security: dict[str, Any] | None = None,
         restart: str = "Always") -> dict[str, Any]:
    c: dict[str, Any] = {"name": "main", "image": image, "imagePullPolicy": "Never"}
    if command:
        c["command"] = command
    if args:
        c["args"] = args
    if security:
        c["securityContext"] = security
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": rp.ns},
            "spec": {"nodeName": rp.node.name, "terminationGracePeriodSeconds": 1, "restartPolicy": restart,
                     "securityContext": pod_security or {}, "containers": [c]}}


def _wait_done(rp: RealPods, name: str, timeout: float = 90) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    pod: dict[str, Any] = {}
    while time.monotonic() < deadline:
        pod = rp.get(name)
        if pod.get("status", {}).get("phase") in ("Succeeded", "Failed"):
            return pod
        time.sleep(0.3)
    raise AssertionError(f"pod {name} not finished after {timeout} s: {pod.get('status')}")


def _archive_configs() -> dict[str, dict[str, Any]]:
    """ref -> image config, read back from the archive that was imported."""
    img = productimages.build_product_images()  # cached: the archive the fixture imported
    out = {}
    with tarfile.open(img.archive) as t:
        for m in json.load(t.extractfile("manifest.json")):  # type: ignore[arg-type]
            out[m["RepoTags"][0]] = json.load(t.extractfile(m["Config"]))  # type: ignore[arg-type]
    return out


def test_image_config_matches_the_dockerfiles(real_node: RealNode, product: dict[str, str]) -> None:
    assert set(product.values()) <= set(real_node.ctr("images", "ls", "-q").stdout.split())
    version = productimages.version()
    assert product == {"operator": f"kvgpu.local/kvgpu-operator:{version}",
                       "agent": f"kvgpu.local/kvgpu-agent:{version}"}
    configs = _archive_configs()
    for which in ("operator", "agent"):
        want = productimages.dockerfile_config(REPO_ROOT / f"Dockerfile.{which}")
        cfg = configs[product[which]]["config"]
        assert cfg["Entrypoint"] == want["ENTRYPOINT"] == ["kvgpu"], (which, cfg)
        assert cfg["Cmd"] == want["CMD"] == [which], (which, cfg)
        assert cfg["User"] == want["USER"], (which, cfg)
        env = dict(e.split("=", 1) for e in cfg["Env"])
        assert env["PATH"].startswith("/opt/kvgpu/venv/bin:"), env
        assert env["PYTHONUNBUFFERED"] == env["PYTHONDONTWRITEBYTECODE"] == "1", env
    # the agent image is the operator's layers plus one (the shim)
    op_layers = configs[product["operator"]]["rootfs"]["diff_ids"]
    ag_layers = configs[product["agent"]]["rootfs"]["diff_ids"]
    assert ag_layers[:-1] == op_layers and len(ag_layers) == len(op_layers) + 1


@pytest.mark.parametrize("which", ["operator", "agent"])
def test_entrypoint_is_the_kvgpu_cli(real_pods: RealPods, product: dict[str, str], which: str) -> None:
    # args only: the image's Entrypoint ["kvgpu"] runs them
    real_pods.apply(_pod(real_pods, f"help-{which}", product[which], args=["--help"], restart="Never"))
    pod = _wait_done(real_pods, f"help-{which}")
    logs = real_pods.cluster.kubectl("logs", f"help-{which}", "-n", real_pods.ns).stdout
    assert pod["status"]["phase"] == "Succeeded", (pod["status"], logs)
    assert "Commands:" in logs and "operator" in logs and "agent" in logs, logs


def test_operator_image(real_pods: RealPods, product: dict[str, str]) -> None:
    real_pods.apply(_pod(real_pods, "op", product["operator"], command=["sleep", "3600"], security=OPERATOR_SC,
                         pod_security=OPERATOR_POD_SC))
    # and with no securityContext at all: the image's User (Dockerfile: USER 65532:65532) applies
    real_pods.apply(_pod(real_pods, "op-plain", product["operator"], command=["sleep", "3600"]))
    real_pods.wait_running("op")
    real_pods.wait_running("op-plain")
    assert real_pods.exec("op", "sh", "-c", "id -u; id -g").split() == ["65532", "65532"]
    # The kubelet hands containerd the image's uid only (RunAsUser from ImageStatus); containerd
    # then takes the group from the image's /etc/passwd, which has user kvgpu, 65532:65532 (as
    # Dockerfile.operator adds it: Kopf and getpass need getpwuid to succeed).
    assert real_pods.exec("op-plain", "sh", "-c", "id -u; id -g").split() == ["65532", "65532"]
    assert real_pods.exec("op", "python", "-c", "import getpass; print(getpass.getuser())").strip() == "kvgpu"
    assert real_pods.exec("op", "sh", "-c", "command -v kvgpu").strip() == "/opt/kvgpu/venv/bin/kvgpu"
    out = real_pods.exec("op", "kvgpu", "operator", "--help")
    assert "--webhook-port" in out and "--leader-elect" in out, out
    assert "Commands:" in real_pods.exec("op", "python", "-m", "kvgpu.cli.main", "--help")
    assert real_pods.exec("op", "python", "-c", IMPORTS).strip() == "imports ok"
    # it starts on a read-only root file system (byte code compiled at build time)
    assert real_pods.exec("op", "awk", '$2=="/"{print $4}', "/proc/mounts").startswith("ro"), "root not read-only"
    # no shim in the operator image
    assert "absent" in real_pods.exec("op", "sh", "-c", "test -e /opt/kvgpu/lib/libvgpu.so || echo absent")


def test_agent_image(real_pods: RealPods, product: dict[str, str]) -> None:
    real_pods.apply(_pod(real_pods, "ag", product["agent"], command=["sleep", "3600"], security=AGENT_SC))
    real_pods.wait_running("ag")
    assert real_pods.exec("ag", "sh", "-c", "id -u; id -g").split() == ["0", "0"]  # USER 0:0
    out = real_pods.exec("ag", "kvgpu", "agent", "--help")
    missing = [f for f in AGENT_FLAGS if f not in out]
    assert not missing, (missing, out)
    assert real_pods.exec("ag", "python", "-c", IMPORTS).strip() == "imports ok"
    # the shim where the DaemonSet's --shim-source points, the file that was built here
    sha = real_pods.exec("ag", "sha256sum", productimages.SHIM_IN_IMAGE).split()[0]
    assert sha == hashlib.sha256(SHIM_SOURCE.read_bytes()).hexdigest()
    # no compiled shim module: the agent reads regions in plain Python (kvgpu.shimregion)
    out = real_pods.exec("ag", "python", "-c", "import importlib.util; print(importlib.util.find_spec('_vgpucore'))")
    assert out.strip() == "None", out
