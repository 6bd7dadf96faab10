"""tests/realnode: the node path on a real kubelet + containerd. The fixtures (``real_node``,
``real_pods``) are in realnode/fixtures.py, registered once for every test directory by
tests/conftest.py; ``RealPods`` is re-exported here for the tests' imports."""

from realnode.fixtures import RealPods

__all__ = ["RealPods"]
