#!/bin/sh
# Regenerates go.mod for a Kubernetes release: one replace per k8s.io staging module
# that k8s.io/kubernetes requires at v0.0.0, mapped to the matching v0.Y.Z tag.
# Usage (in hack/ktp): ./pin-k8s.sh v1.36.3   -- only on a version bump; never `go get -u` here.
set -eu
K8S=$1; STAGING="v0.${K8S#v1.}"
export GOTOOLCHAIN=local GOFLAGS=-mod=mod
[ -f go.mod ] || go mod init kvgpu.invalid/ktp
MOD=$(cd "$(mktemp -d)" && go mod download -json "k8s.io/kubernetes@$K8S" | sed -n 's/.*"GoMod": "\(.*\)".*/\1/p')
awk '$1 ~ /^k8s\.io\// && $2 == "v0.0.0" {print $1}' "$MOD" | sort -u |
  while read -r m; do go mod edit -replace="$m=$m@$STAGING"; done
go mod edit -require="k8s.io/kubernetes@$K8S" -replace="k8s.io/kubernetes=k8s.io/kubernetes@$K8S"
awk '$1 == "godebug" {print $2}' "$MOD" | while read -r g; do go mod edit -godebug="$g"; done
awk '$1 == "go.etcd.io/etcd/server/v3" {print "etcd pinned by k8s:", $2}' "$MOD"
go mod tidy
