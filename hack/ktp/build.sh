#!/usr/bin/env bash
# Builds the ktp multi-call binary (etcd, kube-apiserver, kube-scheduler,
# kube-controller-manager, kubectl, kubelet) from the k8s.io/kubernetes Go modules.
# The result is cached outside the work tree, keyed by Kubernetes version, Go version and
# the go.sum hash:  ${KVGPU_CACHE:-~/.cache/kvgpu}/ktp/<key>/{ktp,etcd,kube-apiserver,...}
# Prints the bin directory on the last line of stdout.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cd "$here"
export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS=-mod=readonly
if ! command -v go >/dev/null; then
  echo "ktp: no Go toolchain on PATH; install Go 1.26 (the module needs go $(awk '$1=="go"{print $2}' go.mod))" >&2
  exit 1
fi
K8S=$(awk '$1=="k8s.io/kubernetes" && $2 ~ /^v1\./ {print $2; exit}' go.mod)
GOV=$(go env GOVERSION)
SUM=$(sha256sum go.sum main.go build.sh | sha256sum | cut -c1-12)
KEY="$K8S-$GOV-$SUM"
OUT="${KVGPU_CACHE:-$HOME/.cache/kvgpu}/ktp/$KEY"
if [ -x "$OUT/ktp" ] && [ -f "$OUT/.complete" ]; then
  echo "$OUT"; exit 0
fi
mkdir -p "$OUT"
MINOR=$(echo "$K8S" | cut -d. -f2); NOW=$(date -u +%Y-%m-%dT%H:%M:%SZ)
LDF="-s -w"
for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  LDF="$LDF -X $p.gitVersion=$K8S -X $p.gitMajor=1 -X $p.gitMinor=$MINOR -X $p.gitTreeState=clean -X $p.buildDate=$NOW"
done
echo "ktp: building Kubernetes $K8S components with $GOV into $OUT" >&2
echo "ktp: a cold build takes 10-25 min on 2 cores; progress below (one line per package compiled)" >&2
start=$(date +%s)
if ! go mod download >&2; then
  echo "ktp: 'go mod download' failed: the Go module proxy must serve k8s.io/kubernetes@$K8S and its graph" >&2
  exit 1
fi
# -v prints each package as it is compiled: the progress indicator of a cold build.
# The full log is kept in $OUT/build.log; every 100th package is echoed.
if ! go build -v -trimpath -ldflags "$LDF" -o "$OUT/ktp.tmp" . 2> >(tee "$OUT/build.log" | awk '{n++; if (n % 100 == 0) {printf "ktp: %d packages compiled (last: %s)\n", n, $0; fflush()}}' >&2); then
  sleep 1
  echo "ktp: go build failed; the last lines of $OUT/build.log:" >&2
  tail -20 "$OUT/build.log" >&2
  exit 1
fi
mv "$OUT/ktp.tmp" "$OUT/ktp"
for c in etcd kube-apiserver kube-controller-manager kube-scheduler kubectl kubelet; do ln -sf ktp "$OUT/$c"; done
"$OUT/kube-apiserver" --version >&2
echo "ktp: built in $(( $(date +%s) - start )) s, $(du -m "$OUT/ktp" | cut -f1) MiB" >&2
touch "$OUT/.complete"
echo "$OUT"
