"""The operator's main process. One asyncio loop runs Kopf (VGPUPool reconciler), the list-and-watch
streams of Nodes and VGPUClaims (:mod:`kvgpu.watch`), the extender's HTTP server and background
tasks, sharing one :class:`OperatorState`. Child processes it starts and watches: the admission
webhook workers (:mod:`kvgpu.admission.server`) and, while it leads, the claim-phase worker
(:mod:`kvgpu.reconcile.phaseworker`).

Start-up order: list nodes, pools and claims → rebuild the ledger → only then does the extender
answer filter/bind (before that it tells kube-scheduler to retry) → the watches keep the state
live. Background tasks write VGPUPool status when it changes (a node's use is not written
anywhere: it is derived from the claims by whoever shows it), re-reserve claims the ledger
lacks, and requeue pending pods when capacity frees.

The package, by concern: :mod:`~kvgpu.runtime.main` (:class:`Runtime`: start-up, the extender,
rebuild, clean-up; :func:`run`), :mod:`~kvgpu.runtime.watches` (the Node and VGPUClaim watch
handlers), :mod:`~kvgpu.runtime.background` (flush: per-node metrics and VGPUPool status; sweep;
requeue), :mod:`~kvgpu.runtime.lease` (leader election), :mod:`~kvgpu.runtime.children` (the
admission workers and the watchdog over the children), :mod:`~kvgpu.runtime.base` (the
configuration and the state they share).
"""

from kvgpu.runtime.base import OperatorConfig
from kvgpu.runtime.main import Runtime, build, run
from kvgpu.runtime.watches import pod_holds

__all__ = ["OperatorConfig", "Runtime", "build", "pod_holds", "run"]
