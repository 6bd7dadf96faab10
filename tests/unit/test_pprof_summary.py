"""bench/scale/pprof_summary.py: where kube-apiserver's CPU goes, from ``go tool pprof -traces``
text (no profile or Go needed here)."""

from __future__ import annotations

import pytest

from bench.scale.pprof_summary import OTHER, parse_traces, shares

TRACES = """File: ktp
Type: cpu
-----------+-------------------------------------------------------
      30ms   k8s.io/apiserver/pkg/storage/etcd3.(*store).Create
             k8s.io/apiextensions-apiserver/pkg/apiserver.(*crdHandler).ServeHTTP
             net/http.HandlerFunc.ServeHTTP
-----------+-------------------------------------------------------
      20ms   crypto/tls.(*Conn).HandshakeContext
             k8s.io/apiserver/pkg/admission/plugin/webhook/mutating.(*mutatingDispatcher).callAttrMutatingHook
-----------+-------------------------------------------------------
     0.01s   github.com/google/cel-go/interpreter.(*evalOr).Eval
             k8s.io/apiserver/pkg/admission/plugin/policy/validating.(*validator).Validate
             k8s.io/apiextensions-apiserver/pkg/apiserver.(*crdHandler).ServeHTTP
-----------+-------------------------------------------------------
      20ms   github.com/google/cel-go/interpreter.(*evalOr).Eval
             k8s.io/apiserver/pkg/admission/plugin/policy/validating.(*validator).Validate
             k8s.io/apiserver/pkg/endpoints/handlers.CreateResource.createHandler.func1.2
-----------+-------------------------------------------------------
      20ms   runtime.memmove (inline)
             net/http.(*conn).serve
"""


def test_each_sample_counts_once_for_the_first_activity_it_belongs_to() -> None:
    stacks = parse_traces(TRACES)
    assert [s for s, _ in stacks] == pytest.approx([0.03, 0.02, 0.01, 0.02, 0.02])
    assert stacks[4][1] == ["runtime.memmove (inline)", "net/http.(*conn).serve"]
    got = shares(stacks)
    assert got["_cpu_s"] == pytest.approx(0.1)
    assert got["VGPUClaim create (custom resource handler)"] == 30.0  # its etcd write included
    assert got["admission: kvgpu's mutating webhook call (request, TLS, JSON patch, decode)"] == 20.0
    assert got["admission: the VGPUClaim policy (CEL)"] == 10.0  # a policy inside a claim create
    assert got["admission: the pod policy (CEL)"] == 20.0
    assert got[OTHER] == 20.0
    assert next(iter(got)) == "VGPUClaim create (custom resource handler)", "largest first"
