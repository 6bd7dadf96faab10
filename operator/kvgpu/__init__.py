"""kvgpu: fractional NVIDIA GPUs for Kubernetes.

Layout (see docs/architecture.md; the layering is checked by ``.importlinter`` in ``make lint``):

- ``kvgpu.core``       shared contract: annotation keys, the node inventory, the claim string
- ``kvgpu.api``        pydantic models of the CRDs; a pod's request (keys, values, pod shape,
                       parser); CRD generation
- ``kvgpu.allocator``  the pure ledger/allocator (no I/O): usage, node, placement, ledger, quotas
- ``kvgpu.extender``   kube-scheduler extender (HTTPS), the bind sequence, GPU preemption
- ``kvgpu.admission``  mutating/validating admission: pure decisions, and our own HTTPS server
                       in worker processes
- ``kvgpu.reconcile``  the operator's state, claim phases and the claim-phase worker, the Kopf
                       VGPUPool handler, quotas
- ``kvgpu.runtime``    the operator's main process: start-up, watch handlers, background, lease,
                       children
- ``kvgpu.watch``, ``kvgpu.kube``, ``kvgpu.procs``  list-and-watch, the API calls, child processes
- ``kvgpu.agent``      node agent: NVML discovery, inventory, device plugin, exporter
- ``kvgpu.devcluster`` the local real control plane and the real node, used by tests and
                       ``make demo``
- ``kvgpu.cli``        ``kvgpu`` and ``kubectl-vgpu`` entry points
"""

__version__ = "0.1.0"
