"""Client of the kubelet's PodResources v1 API (``/var/lib/kubelet/pod-resources/kubelet.sock``).

:meth:`PodResourcesClient.lookup` answers, for one pod, whether the kubelet knows it (``None``: not
in its pod manager) and which of its containers hold devices of the plugin's resource
(:class:`~kvgpu.agent.podidentity.KubeletPod`). It calls ``Get``; where ``Get`` is refused for
another reason than "not found" (the ``KubeletPodResourcesGet`` feature gate off, an old kubelet
without the method), it falls back to ``List`` from then on.

:meth:`PodResourcesClient.lookup_many` answers for several pods at once with one ``List`` — what a
burst needs: the kubelet rate-limits the service (10 calls in a burst, then 100 a second), and a
``Get`` per waiting pod for every ``Allocate`` of a 30-pod burst was refused
(``RESOURCE_EXHAUSTED``), which failed pods' admission. A refusal by the rate limit is retried
for up to ``retry_s``.

The kubelet's ``Get`` answers a plain error (gRPC ``UNKNOWN``) ``pod <name> in namespace <ns> not
found`` for a pod it does not know (k8s v1.36 ``server_v1.go``); that text is what "not found" is
matched on, besides the ``NOT_FOUND`` code.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc import aio

from .podidentity import KubeletPod
from .proto import pr_pb2, pr_pb2_grpc

log = logging.getLogger(__name__)

DEFAULT_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"


class PodResourcesError(RuntimeError):
    """The kubelet's PodResources service could not answer."""


def _allocated(pod: Any, resource: str) -> KubeletPod:
    return KubeletPod(
        frozenset(
            c.name for c in pod.containers if any(d.resource_name == resource and d.device_ids for d in c.devices)
        )
    )


def _not_found(e: grpc.RpcError) -> bool:
    return e.code() == grpc.StatusCode.NOT_FOUND or "not found" in (e.details() or "")


@dataclass
class PodResourcesClient:
    """One channel to the kubelet's PodResources socket (opened on first use)."""

    resource: str
    socket: str = DEFAULT_SOCKET
    timeout_s: float = 5.0
    use_list: bool = False
    retry_s: float = 3.0
    _channel: aio.Channel | None = field(default=None, init=False, repr=False)

    def _stub(self) -> Any:
        if self._channel is None:
            self._channel = aio.insecure_channel(f"unix://{self.socket}")
        return pr_pb2_grpc.PodResourcesListerStub(self._channel)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    def _error(self, e: grpc.RpcError) -> PodResourcesError:
        return PodResourcesError(f"kubelet PodResources at {self.socket}: {e.code().name}: {e.details()}")

    async def lookup(self, namespace: str, name: str) -> KubeletPod | None:
        """The kubelet's view of one pod; ``None`` if it does not know it.

        Raises :class:`PodResourcesError` if neither ``Get`` nor ``List`` answer."""
        if not self.use_list:
            try:
                resp = await self._stub().Get(
                    pr_pb2.GetPodResourcesRequest(pod_name=name, pod_namespace=namespace), timeout=self.timeout_s
                )
                return _allocated(resp.pod_resources, self.resource)
            except grpc.RpcError as e:
                if _not_found(e):
                    return None
                if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise self._error(e) from e
                log.warning("PodResources Get refused (%s: %s); using List", e.code().name, e.details())
                self.use_list = True
        return (await self.lookup_many([(namespace, name)]))[(namespace, name)]

    async def lookup_many(self, pods: Sequence[tuple[str, str]]) -> dict[tuple[str, str], KubeletPod | None]:
        """The kubelet's view of each ``(namespace, name)`` (``None``: not known), from one ``List``.

        Raises :class:`PodResourcesError` if ``List`` does not answer (after ``retry_s`` of
        retries when the kubelet's rate limit refuses it)."""
        if not pods:
            return {}
        deadline = time.monotonic() + self.retry_s
        while True:
            try:
                lst = await self._stub().List(pr_pb2.ListPodResourcesRequest(), timeout=self.timeout_s)
                break
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() >= deadline:
                    raise self._error(e) from e
                await asyncio.sleep(0.05)
        known = {(p.namespace, p.name): _allocated(p, self.resource) for p in lst.pod_resources}
        return {k: known.get(k) for k in pods}
