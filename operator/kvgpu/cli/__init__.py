"""Command-line entry points: ``kvgpu`` (operator, agent, dev cluster) and ``kubectl-vgpu``."""
