#!/usr/bin/env bash
# Filter calls that open a new TLS connection when kube-scheduler's filter and bind share one
# extender entry (one connection pool) or use one entry each. Needs Go and the project's venv.
# Usage: bash bench/scale/extender_pools/run.sh [PODS] [BIND_MS]   (from the repository root)
set -euo pipefail
PODS=${1:-1500}
BIND_MS=${2:-300}
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../../.." && pwd)
tmp=$(mktemp -d)
server=""
cleanup() { [ -n "$server" ] && kill "$server" 2>/dev/null; rm -rf "$tmp"; }
trap cleanup EXIT
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout "$tmp/key.pem" \
    -out "$tmp/cert.pem" -days 1 -subj /CN=localhost -addext subjectAltName=DNS:localhost 2>/dev/null
(cd "$here" && go build -o "$tmp/extender_pools" .)
port=$("$root/.venv/bin/python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
PYTHONPATH="$root/operator" "$root/.venv/bin/python" "$here/server.py" "$tmp/cert.pem" "$tmp/key.pem" "$port" \
    --bind-ms "$BIND_MS" &
server=$!
for _ in $(seq 50); do (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break; sleep 0.1; done
echo "$(date -u +%Y-%m-%dT%H:%M:%SZ), $(nproc) cores, $PODS pods, binds answered after $BIND_MS ms"
for mode in shared split shared split; do
    "$tmp/extender_pools" "https://localhost:$port" "$tmp/cert.pem" "$PODS" "$mode"
done
