"""The kvgpu API: VGPUPool and VGPUClaim (group ``kvgpu.io``, version ``v1alpha1``).

Pydantic v2 models, frozen, with camelCase aliases: ``Model.model_validate(body)`` reads an
object as the API server returns it, ``model.model_dump(by_alias=True, exclude_none=True)``
writes it. The CRDs in ``charts/kvgpu/crds/`` and the reference in ``docs/api.md`` are generated from these
classes by :mod:`kvgpu.api.crdgen`; field descriptions, ranges and defaults live here only.

Units everywhere: memory in MiB (integers), cores in percent of a card's SMs (0..100).
"""

# The models live in three modules; every name stays importable from here.
from kvgpu.api.modelbase import *  # noqa: F403
from kvgpu.api.modelbase import _Model as _Model  # the quota models build on it
from kvgpu.api.vgpuclaim import *  # noqa: F403
from kvgpu.api.vgpupool import *  # noqa: F403
