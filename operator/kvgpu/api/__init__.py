"""The kvgpu API: CRD models, request parsing, pool coverage, CRD and reference generation.

- :mod:`kvgpu.api.models` — VGPUPool / VGPUClaim (pydantic v2, frozen, camelCase aliases);
- :mod:`kvgpu.api.requests` — ``parse_pod``, ``validate_pod``, ``wants_slices``, ``RequestError``;
- :mod:`kvgpu.api.pools` — ``effective_slicing``, ``covering_pool``, ``conflicts``, ``defaults_pool``,
  ``pool_conditions``;
- :mod:`kvgpu.api.crdgen` — ``crds/*.yaml`` and ``docs/api.md`` (``make crds``).
"""
