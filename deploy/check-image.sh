#!/usr/bin/env bash
# Build the cpu image, run it, and check it from outside the container the way a client
# and an operator meet it: /health turns 200, a completion comes back, /metrics serves
# the gauges the chart's autoscalers read, the CPU kernel compiles on this machine, and
# the shipped extras (sglang-router, `sluice bench serving`) are there.
#
#   make check-image                                   # docker, or podman where docker is absent
#   SKIP_BUILD=1 IMAGE=registry.local/sluice:0.1.0-cpu deploy/check-image.sh
#   BUILD_ARGS="--build-arg TORCH_INDEX_URL=https://pypi.org/simple" make check-image
#   ENGINE="podman --runtime runc" RUN_ARGS="--ulimit nofile=4096:4096" make check-image
#
# A developer's check, not CI's: it needs a container engine and the network the build
# uses (Docker Hub for ubuntu:24.04, PyPI, download.pytorch.org). See deploy/README.md.
set -euo pipefail

cd "$(dirname "$0")/.."
IMAGE=${IMAGE:-sluice:check-cpu}
NAME=${NAME:-sluice-check-$$}
START_TIMEOUT=${START_TIMEOUT:-300}   # seconds: first start converts the model and compiles the kernel
MODEL=smollm2
if [[ -z "${ENGINE:-}" ]]; then
  if command -v docker >/dev/null && docker info >/dev/null 2>&1; then ENGINE=docker
  elif command -v podman >/dev/null; then ENGINE=podman
  else echo "check-image: no container engine (docker with a running daemon, or podman)" >&2; exit 2
  fi
fi
read -r -a engine <<<"$ENGINE"
read -r -a build_args <<<"${BUILD_ARGS:-}"
read -r -a run_args <<<"${RUN_ARGS:-}"

fail() { echo "check-image: FAIL: $*" >&2; exit 1; }
step() { echo "check-image: $*"; }

if [[ -z "${SKIP_BUILD:-}" ]]; then
  format=()
  # podman/buildah write OCI images by default, which drop SHELL and HEALTHCHECK.
  [[ "${engine[0]}" != docker ]] && format=(--format docker)
  step "building $IMAGE (target cpu) with ${ENGINE}"
  "${engine[@]}" build "${format[@]}" --target cpu "${build_args[@]}" -t "$IMAGE" .
fi

port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
base=http://127.0.0.1:$port
cleanup() {
  if [[ -n "${KEEP:-}" ]]; then step "kept container $NAME on $base"; return; fi
  "${engine[@]}" rm -f "$NAME" >/dev/null 2>&1 || true
}
trap cleanup EXIT

step "starting $NAME on $base"
"${engine[@]}" run -d --name "$NAME" -p "127.0.0.1:$port:30000" --shm-size 1g "${run_args[@]}" \
  "$IMAGE" --served-model-name "$MODEL" >/dev/null

deadline=$((SECONDS + START_TIMEOUT))
until [[ "$(curl -s -o /dev/null -w '%{http_code}' "$base/health")" == 200 ]]; do
  if [[ "$("${engine[@]}" inspect -f '{{.State.Running}}' "$NAME" 2>/dev/null)" != true ]]; then
    "${engine[@]}" logs "$NAME" 2>&1 | tail -40 >&2
    fail "the container exited before /health answered 200"
  fi
  ((SECONDS < deadline)) || { "${engine[@]}" logs "$NAME" 2>&1 | tail -40 >&2; fail "/health not 200 after ${START_TIMEOUT}s"; }
  sleep 2
done
step "/health: 200"

completion=$(curl -sf "$base/v1/completions" -H 'Content-Type: application/json' \
  -d '{"model": "'"$MODEL"'", "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}') \
  || fail "POST /v1/completions did not answer 2xx"
python3 - "$completion" <<'EOF' || fail "unexpected completion: $completion"
import json, sys
body = json.loads(sys.argv[1])
assert body["choices"][0]["text"].strip(), "empty text"
assert body["usage"]["completion_tokens"] > 0, "no tokens generated"
print("check-image: completion:", repr(body["choices"][0]["text"]))
EOF

metrics=$(curl -sf "$base/metrics") || fail "GET /metrics did not answer 2xx"
# The KEDA/HPA autoscaling in the chart reads sglang:num_queue_reqs.
grep -q '^sglang:num_queue_reqs' <<<"$metrics" || fail "/metrics lacks sglang:num_queue_reqs"
grep -Eq '^sglang:generation_tokens_total\{[^}]*\} [1-9]' <<<"$metrics" || fail "/metrics counted no generated tokens"
step "/metrics: sglang:num_queue_reqs present, generation tokens counted"

# The fast CPU decode path: the kernel compiles on this (the run) machine. The first
# start built it already; prepare reports it from the cache.
prepare=$("${engine[@]}" exec "$NAME" sluice prepare 2>&1) || fail "sluice prepare failed: $prepare"
grep -q 'CPU paged-decode kernel: ready' <<<"$prepare" || fail "the CPU kernel does not build in the image: $prepare"
step "CPU paged-decode kernel: ready"

"${engine[@]}" exec "$NAME" sluice bench serving --help >/dev/null || fail "sluice bench serving is broken in the image"
"${engine[@]}" exec "$NAME" python3 -m sglang_router.launch_router --help >/dev/null \
  || fail "sglang-router (DP and PD front end) is missing from the image"
step "sluice bench serving and sglang-router run"
step "OK: $IMAGE"
