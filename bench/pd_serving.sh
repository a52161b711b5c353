#!/usr/bin/env bash
# `sluice bench serving` at one request rate against (a) one server and (b) a prefill
# server + a decode server behind sglang-router in --pd-disaggregation mode, on this
# machine (issue #12's measurement). Same dataset, seed and rate for both; each server
# runs the defaults; the arms alternate (A B A B) so that drifting load hits both.
#
#   bash bench/pd_serving.sh [RATE] [NUM_PROMPTS] [BACKEND]     (defaults 1 32 tcp)
set -eu
RATE=${1:-1}
N=${2:-32}
BACKEND=${3:-tcp}
BIN=${BIN:-.venv/bin}
OUT=${OUT:-bench/results/pd_serving.jsonl}
LOGS=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

wait_ready() {  # URL
    for _ in $(seq 600); do
        curl -sf "$1/health" >/dev/null 2>&1 && return 0
        sleep 0.5
    done
    echo "not ready: $1 (logs in $LOGS)" >&2
    exit 1
}

serve() {  # NAME ARGS...
    local name=$1; shift
    "$BIN/sluice" serve --log-level warning "$@" >"$LOGS/$name.log" 2>&1 &
    pids+=($!)
}

bench() {  # LABEL URL
    echo "== $1" >&2
    "$BIN/sluice" bench serving --base-url "$2" --request-rate "$RATE" --num-prompts "$N" \
        --random-input-len 256 --random-output-len 64 --seed 1 --disable-tqdm --output-file "$OUT" \
        | grep -E "Backend|Request rate|Output token throughput|Median TTFT|P99 TTFT|Median ITL|P99 ITL|Median E2E"
}

serve single --port 31000
serve prefill --port 31001 --disaggregation-mode prefill --disaggregation-bootstrap-port 31998 \
    --disaggregation-transfer-backend "$BACKEND"
serve decode --port 31002 --disaggregation-mode decode --disaggregation-transfer-backend "$BACKEND"
"$BIN/python" -m sglang_router.launch_router --host 127.0.0.1 --port 31003 --pd-disaggregation \
    --prefill http://127.0.0.1:31001 31998 --decode http://127.0.0.1:31002 >"$LOGS/router.log" 2>&1 &
pids+=($!)
for url in http://127.0.0.1:31000 http://127.0.0.1:31001 http://127.0.0.1:31002 http://127.0.0.1:31003; do wait_ready "$url"; done

for round in 1 2; do
    bench "one server (round $round)" http://127.0.0.1:31000
    bench "PD via sglang-router, $BACKEND (round $round)" http://127.0.0.1:31003
done
