"""The real node's configuration files (kvgpu.devcluster.nodeconfig) and its machine-wide lock,
without root; the node itself is exercised by tests/realnode."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest
from kvgpu.devcluster import nodeconfig, realhost


def test_containerd_config_parses_and_names_the_wrapper() -> None:
    d = Path("/rn")
    plain = tomllib.loads(nodeconfig.containerd_config(d, Path("/s.sock"), d / "runc", Path("/cni")))
    assert plain["grpc"]["address"] == "/s.sock"
    runtime = plain["plugins"]["io.containerd.cri.v1.runtime"]
    opts = runtime["containerd"]["runtimes"]["runc"]["options"]
    assert opts == {"SystemdCgroup": False, "Root": "/rn/runc"}
    assert runtime["cni"] == {"bin_dirs": ["/cni"], "conf_dir": "/rn/cni/net.d"}
    wrapped = tomllib.loads(nodeconfig.containerd_config(d, Path("/s.sock"), d / "runc", Path("/cni"),
                                                         d / "runc-debug.sh"))
    assert wrapped["plugins"]["io.containerd.cri.v1.runtime"]["containerd"]["runtimes"]["runc"]["options"][
        "BinaryName"] == "/rn/runc-debug.sh"
    script = nodeconfig.runc_debug_wrapper(d / "dbg", "/usr/bin/runc")
    assert "d=/rn/dbg;" in script and "/usr/bin/runc --debug" in script
    assert "@DIR@" not in script and "@RUNC@" not in script


def test_kubelet_and_cni_config() -> None:
    cfg = json.loads(nodeconfig.kubelet_config(Path("/s.sock"), "10.250.0.1", "10.244.0.0/24"))
    assert cfg["containerRuntimeEndpoint"] == "unix:///s.sock" and cfg["address"] == "10.250.0.1"
    assert cfg["podCIDR"] == "10.244.0.0/24"
    cni = json.loads(nodeconfig.cni_conflist("10.244.0.0/24"))
    assert cni["plugins"][0]["bridge"] == realhost.POD_BRIDGE
    assert cni["plugins"][0]["ipam"]["ranges"] == [[{"subnet": "10.244.0.0/24"}]]


def test_host_lock_is_exclusive_and_names_its_holder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(realhost, "LOCK_FILE", tmp_path / "lock" / "realnode.lock")
    f = realhost.take_host_lock("pid 1 run dir /a")
    with pytest.raises(realhost.RealNodeUnavailable, match="held by pid 1 run dir /a"):
        realhost.take_host_lock("pid 2")
    realhost.release_host_lock(f)
    assert realhost.LOCK_FILE.read_text() == ""
    realhost.release_host_lock(realhost.take_host_lock("pid 3"))
