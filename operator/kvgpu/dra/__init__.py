"""kvgpu as a DRA driver (``gpu.kvgpu.io``): the pure parts shared by the node agent's kubelet
plugin, the operator's claim mirror and the benchmarks. No I/O here.

- :mod:`kvgpu.dra.slices`: a node's cards as ResourceSlices (devices with consumable capacity:
  ``memory`` in MiB, ``cores`` in percent of SMs, ``shares`` of the pool's split count) and the
  DeviceClasses;
- :mod:`kvgpu.dra.claims`: an allocated ResourceClaim as the node prepares it (the shim's claim
  string, every refusal named);
- :mod:`kvgpu.dra.cdi`: the CDI spec that gives a prepared claim's containers their edits.
"""
