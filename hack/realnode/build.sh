#!/usr/bin/env bash
# Builds containerd (containerd, containerd-shim-runc-v2, ctr) from its Go module for the dev
# cluster's real node (operator/kvgpu/devcluster/realnode.py). Static binaries, no cgo.
# Cached outside the work tree, keyed by containerd version, Go version and this script:
#   ${KVGPU_CACHE:-~/.cache/kvgpu}/containerd/<key>/{containerd,containerd-shim-runc-v2,ctr}
# runc and the CNI plugins come from the distribution (see `make realnode`).
# Progress on stderr; prints the bin directory on the last line of stdout.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
VERSION=${KVGPU_CONTAINERD_VERSION:-v2.2.9}
TAGS="no_btrfs no_devmapper no_zfs no_aufs"
export GOTOOLCHAIN=local CGO_ENABLED=0
if ! command -v go >/dev/null; then
  echo "realnode: no Go toolchain on PATH; install Go 1.24+ to build containerd $VERSION" >&2
  exit 1
fi
GOV=$(go env GOVERSION)
SUM=$(sha256sum "$here/build.sh" | cut -c1-12)
KEY="$VERSION-$GOV-$SUM"
OUT="${KVGPU_CACHE:-$HOME/.cache/kvgpu}/containerd/$KEY"
if [ -f "$OUT/.complete" ] && [ -x "$OUT/containerd" ] && [ -x "$OUT/containerd-shim-runc-v2" ] && [ -x "$OUT/ctr" ]; then
  echo "$OUT"; exit 0
fi
mkdir -p "$OUT"
echo "realnode: building containerd $VERSION with $GOV into $OUT (about 70 s on 2 cores)" >&2
start=$(date +%s)
mod=github.com/containerd/containerd/v2/cmd
if ! GOBIN="$OUT" GOFLAGS= go install -trimpath -ldflags "-s -w" -tags "$TAGS" \
    "$mod/containerd@$VERSION" "$mod/containerd-shim-runc-v2@$VERSION" "$mod/ctr@$VERSION" >&2; then
  echo "realnode: 'go install' of containerd $VERSION failed: the Go module proxy must serve github.com/containerd/containerd/v2@$VERSION" >&2
  exit 1
fi
"$OUT/containerd" --version >&2
echo "realnode: built in $(( $(date +%s) - start )) s" >&2
touch "$OUT/.complete"
echo "$OUT"
