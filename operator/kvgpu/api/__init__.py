"""The kvgpu API: CRD models, request parsing, pool coverage, CRD and reference generation.

- :mod:`kvgpu.api.models` — VGPUPool / VGPUClaim (pydantic v2, frozen, camelCase aliases; the
  classes live in :mod:`~kvgpu.api.vgpupool`, :mod:`~kvgpu.api.vgpuclaim` and
  :mod:`~kvgpu.api.modelbase`);
- :mod:`kvgpu.api.requests` — ``parse_pod``, ``validate_pod``, ``wants_slices``, ``RequestError``
  (and every name of its parts: :mod:`~kvgpu.api.request_keys`, the key catalogue;
  :mod:`~kvgpu.api.values`, the errors and value parsers; :mod:`~kvgpu.api.podshape`, where a
  pod's request is written);
- :mod:`kvgpu.api.pools` — ``effective_slicing``, ``covering_pool``, ``conflicts``, ``defaults_pool``,
  ``pool_conditions``;
- :mod:`kvgpu.api.crdgen` — ``charts/kvgpu/crds/*.yaml`` and ``docs/api.md`` (``make crds``), from
  :mod:`~kvgpu.api.crdschema` and :mod:`~kvgpu.api.apidoc`.
"""
