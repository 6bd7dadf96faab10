"""What the real node's daemons are configured with, as files: containerd's ``config.toml``, the
CNI conflist of the pod bridge, the kubelet's ``KubeletConfiguration``, the runc wrapper of
``RealNode(runc_debug=True)``, and the simulated node's cards (driver folder, fake device nodes,
the NVML stand-in ``sim.json``).

Functions of their inputs only: :class:`~kvgpu.devcluster.realnode.RealNode` decides the paths
and writes the files; nothing here starts a process or reads the host.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from kvgpu.devcluster import images
from kvgpu.devcluster.realhost import CNI_NETWORK, NVIDIA_MAJOR, NVIDIACTL_MINOR, POD_BRIDGE, UVM_MAJOR

RUNC_DEBUG_WRAPPER = """#!/bin/sh
# runc wrapper (RealNode(runc_debug=True)): keeps each bundle's config.json, and runc's debug log
# of every failed call, in @DIR@ (fail.log).
d=@DIR@; b=""; prev=""
for a in "$@"; do [ "$prev" = "--bundle" ] && b="$a"; prev="$a"; done
[ -n "$b" ] && cp "$b/config.json" "$d/$(basename "$b").json" 2>/dev/null
@RUNC@ --debug "$@"; rc=$?
if [ $rc -ne 0 ] && [ -n "$b" ]; then
  echo "== rc=$rc $*" >> $d/fail.log; cat "$b/log.json" >> $d/fail.log 2>/dev/null
fi
exit $rc
"""


def runc_debug_wrapper(debug_dir: Path, runc: str) -> str:
    """The wrapper script that keeps bundles and runc's debug log of failed calls in ``debug_dir``."""
    return RUNC_DEBUG_WRAPPER.replace("@DIR@", str(debug_dir)).replace("@RUNC@", runc)


def containerd_config(node_dir: Path, socket: Path, runc_root: Path, cni_bin: Path | None,
                      runc_binary: Path | None = None) -> str:
    """containerd 2.2's ``config.toml`` (version 3): state under ``node_dir/containerd``, the CRI
    plugin with runc (``runc_binary`` in place of runc when given), CDI and the CNI bridge."""
    c = node_dir / "containerd"
    runtime_opts = ["SystemdCgroup = false", f"Root = '{runc_root}'"]
    if runc_binary is not None:
        runtime_opts.append(f"BinaryName = '{runc_binary}'")
    opts = "\n        ".join(runtime_opts)
    return f"""version = 3
root = '{c / "root"}'
state = '{c / "state"}'
disabled_plugins = ['io.containerd.nri.v1.nri']
[grpc]
  address = '{socket}'
[plugins.'io.containerd.internal.v1.opt']
  path = '{node_dir / "opt"}'
[plugins.'io.containerd.cri.v1.images']
  snapshotter = 'overlayfs'
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = '{images.PAUSE}'
[plugins.'io.containerd.cri.v1.runtime']
  restrict_oom_score_adj = true  # root here lacks CAP_SYS_RESOURCE: the kubelet's -998 would fail
  enable_cdi = true
  cdi_spec_dirs = ['{node_dir / "cdi"}']  # RealNode.cdi_dir: the agent's DRA plugin writes there
  netns_mounts_under_state_dir = false
  [plugins.'io.containerd.cri.v1.runtime'.containerd]
    default_runtime_name = 'runc'
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
      runtime_type = 'io.containerd.runc.v2'
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
        {opts}
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ['{cni_bin}']
    conf_dir = '{node_dir / "cni" / "net.d"}'
"""


def cni_conflist(pod_cidr: str) -> str:
    """The pod network: a bridge with host-local addresses from ``pod_cidr``, and loopback."""
    conf = {"cniVersion": "0.4.0", "name": CNI_NETWORK, "plugins": [
        {"type": "bridge", "bridge": POD_BRIDGE, "isGateway": True, "ipMasq": False, "hairpinMode": True,
         "ipam": {"type": "host-local", "ranges": [[{"subnet": pod_cidr}]],
                  "routes": [{"dst": "0.0.0.0/0"}]}},
        {"type": "loopback"}]}
    return json.dumps(conf, indent=2)


def kubelet_config(socket: Path, node_ip: str, pod_cidr: str) -> str:
    """The kubelet's ``KubeletConfiguration`` (JSON): cgroupfs, anonymous auth, no image GC nor
    iptables chains, fast status updates."""
    cfg = {
        "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
        "cgroupDriver": "cgroupfs",
        "failCgroupV1": False,  # default true since 1.35; this VM has the v1 hierarchy
        "failSwapOn": False,
        "containerRuntimeEndpoint": f"unix://{socket}", "imageServiceEndpoint": f"unix://{socket}",
        "address": node_ip, "port": 10250, "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1", "healthzPort": 10248,
        "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False}},
        "authorization": {"mode": "AlwaysAllow"},
        "clusterDomain": "cluster.local", "resolvConf": "/etc/resolv.conf",
        "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
        "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%", "imagefs.available": "1%"},
        "registerNode": True, "serializeImagePulls": False,
        "makeIPTablesUtilChains": False,  # no KUBE-* chains left on the host
        "podCIDR": pod_cidr,
        "syncFrequency": "10s", "nodeStatusUpdateFrequency": "5s",
    }
    return json.dumps(cfg, indent=2)


def write_simulated_cards(node_name: str, cards: int, driver_root: Path, dev_root: Path,
                          sim_file: Path) -> None:
    """The simulated node's driver folder (the stub driver), fake device nodes (``nvidia<i>``,
    ``nvidiactl``, ``nvidia-uvm``, ``nvidia-uvm-tools``; needs root) and ``sim.json``, the NVML
    stand-in the agent reads: ``cards`` H200s."""
    images.build_driver_root(driver_root)
    dev_root.mkdir()
    nodes = [(f"nvidia{i}", NVIDIA_MAJOR, i) for i in range(cards)]
    nodes += [("nvidiactl", NVIDIA_MAJOR, NVIDIACTL_MINOR), ("nvidia-uvm", UVM_MAJOR, 0),
              ("nvidia-uvm-tools", UVM_MAJOR, 1)]
    for n, major, minor in nodes:
        os.mknod(dev_root / n, 0o666 | 0o020000, os.makedev(major, minor))
        os.chmod(dev_root / n, 0o666)
    sim_file.write_text(json.dumps({"nodes": [{"name": node_name, "cards": [
        {"model": "NVIDIA H200", "memoryMiB": 143771, "smCount": 132, "numa": 0, "count": cards}]}]},
        indent=2))
