"""kvgpu: fractional NVIDIA GPUs for Kubernetes.

Layout (see docs/architecture.md):

- ``kvgpu.core``       shared contract: annotation keys, the node inventory, the claim string
- ``kvgpu.api``        pydantic models of the CRDs and of a pod's request; CRD generation
- ``kvgpu.allocator``  the pure ledger/allocator (no I/O)
- ``kvgpu.extender``   kube-scheduler extender (HTTP)
- ``kvgpu.admission``  mutating/validating admission (Kopf webhooks)
- ``kvgpu.reconcile``  Kopf reconcilers for pods, claims, pools, nodes
- ``kvgpu.agent``      node agent: NVML discovery, inventory, device plugin, exporter
- ``kvgpu.devcluster`` the local real control plane used by tests and ``make demo``
- ``kvgpu.cli``        ``kvgpu`` and ``kubectl-vgpu`` entry points
"""

__version__ = "0.1.0"
