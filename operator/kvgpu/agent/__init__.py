"""The node agent (DaemonSet): discovery, inventory registration, health, kubelet device plugin,
shim installation and the usage exporter. Entry point: :func:`kvgpu.agent.main.run`."""
