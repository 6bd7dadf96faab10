"""What the NVIDIA container runtime gives a pod, for the real node, which has no NVIDIA container
toolkit: a kubelet device plugin for the resource :data:`RESOURCE` whose one device, once
allocated, gives the container every card's device node, the control nodes and the driver's
``lib64`` and ``bin`` folders (read-only, on ``/usr/local/nvidia``), as the runtime does for
``NVIDIA_VISIBLE_DEVICES=all`` with the ``compute,utility`` capabilities.

It is for the chart's pods that rely on the runtime and ask the device plugin for nothing: the
MPS daemons' owner (``kvgpu-mps``, ``runtimeClassName`` of the GPU nodes) run by
bench/gpu/realnode_run.py on the GPU machine. Without it such a pod could reach the cards only
as ``privileged``, which would hide what its own security context allows. A pod asks for it with
``resources.limits: {RESOURCE: 1}``; the device is shared (100 IDs), never exhausted.

    plugin = RuntimePlugin(dev_root="/dev", driver_root="/usr/local/nvidia").start()
    ...
    plugin.stop()
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from kvgpu.agent.devicespecs import CONTROL_NODES, driver_mounts
from kvgpu.agent.proto import pb2, pb2_grpc
from kvgpu.devcluster.realhost import KUBELET_ROOT

RESOURCE = "devcluster.kvgpu.io/nvidia-runtime"
ENDPOINT = "kvgpu-devcluster-nvidia-runtime.sock"
IDS = 100


def runtime_device_specs(dev_root: str | Path) -> list[Any]:
    """Every card's node (``nvidia<N>``) and the control nodes under ``dev_root``, on ``/dev``."""
    root = Path(dev_root)
    cards = sorted((p.name for p in root.glob("nvidia[0-9]*") if p.name[6:].isdigit()), key=lambda n: int(n[6:]))
    names = cards + [n for n in CONTROL_NODES if (root / n).exists()]
    return [pb2.DeviceSpec(container_path=f"/dev/{n}", host_path=str(root / n), permissions="rw") for n in names]


class _Servicer(pb2_grpc.DevicePluginServicer):
    def __init__(self, plugin: RuntimePlugin) -> None:
        self.p = plugin

    def GetDevicePluginOptions(self, request: Any, context: Any) -> Any:
        return pb2.DevicePluginOptions()

    def ListAndWatch(self, request: Any, context: Any) -> Iterator[Any]:
        yield pb2.ListAndWatchResponse(devices=[pb2.Device(ID=f"runtime-{i}", health="Healthy")
                                                for i in range(IDS)])
        self.p._stopping.wait()

    def Allocate(self, request: Any, context: Any) -> Any:
        out = [pb2.ContainerAllocateResponse(devices=runtime_device_specs(self.p.dev_root),
                                             mounts=driver_mounts(self.p.driver_root))
               for _ in request.container_requests]
        self.p.allocations += len(out)
        return pb2.AllocateResponse(container_responses=out)

    def PreStartContainer(self, request: Any, context: Any) -> Any:
        return pb2.PreStartContainerResponse()


@dataclass
class RuntimePlugin:
    """The stand-in for the NVIDIA runtime (module docstring): :meth:`start` serves and registers
    with the kubelet, :meth:`stop` ends it (the kubelet then offers no more of it)."""

    dev_root: str | Path = "/dev"
    driver_root: str | None = "/usr/local/nvidia"
    socket_dir: Path = KUBELET_ROOT / "device-plugins"
    allocations: int = 0
    _stopping: threading.Event = field(default_factory=threading.Event, repr=False)
    _server: Any = field(default=None, repr=False)

    @property
    def socket_path(self) -> Path:
        return self.socket_dir / ENDPOINT

    def start(self, timeout: float = 10.0) -> RuntimePlugin:
        self._stopping.clear()
        self.socket_path.unlink(missing_ok=True)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        pb2_grpc.add_DevicePluginServicer_to_server(_Servicer(self), server)
        server.add_insecure_port(f"unix://{self.socket_path}")
        server.start()
        self._server = server
        with grpc.insecure_channel(f"unix://{self.socket_dir / 'kubelet.sock'}") as ch:
            pb2_grpc.RegistrationStub(ch).Register(
                pb2.RegisterRequest(version="v1beta1", endpoint=ENDPOINT, resource_name=RESOURCE,
                                    options=pb2.DevicePluginOptions()), timeout=timeout)
        return self

    def stop(self) -> None:
        self._stopping.set()
        if self._server is not None:
            self._server.stop(0.5).wait(5)
            self._server = None
        self.socket_path.unlink(missing_ok=True)


__all__ = ["ENDPOINT", "RESOURCE", "RuntimePlugin", "runtime_device_specs"]
