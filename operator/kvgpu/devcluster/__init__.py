"""A real local Kubernetes control plane (etcd, kube-apiserver, kube-scheduler, optional
kube-controller-manager) built from the k8s.io/kubernetes Go modules (hack/ktp), for tests,
``make demo`` and ``kvgpu dev up/down``. See docs/development.md."""

from kvgpu.devcluster.cluster import Cluster, ClusterError, ensure_binaries

__all__ = ["Cluster", "ClusterError", "ensure_binaries"]
