#!/usr/bin/env bash
# The GPU suite, the roofline and the GPU benchmarks on a bare CUDA machine with no
# network (a lent machine): packages come as wheels from .whl/, the tokenizer from
# .gpu/tokenizer/ (the embedded GGUF is too large to carry), FlashInfer's JIT cache
# from .gpu/jit-cache.tar.* when an earlier run saved one.
#
#   bash tests/gpu/run_lent.sh STEP...      steps: tests roofline profile bench
#
# Each step logs to $OUT/<step>.log; the JIT cache is saved to $OUT at the end.
# Preparing .whl/ and .gpu/ on a machine with pip: see docs/gpu.md.
set -u
OUT=${OUT:-/tmp/sluice-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
start=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
export SLUICE_TOKENIZER_DIR=$PWD/.gpu/tokenizer
export FLASHINFER_WORKSPACE_BASE=/tmp/fi-base
mkdir -p "$FLASHINFER_WORKSPACE_BASE"
# An earlier run's modules go where FlashInfer looks for AOT builds (data/aot/NAME/NAME.so):
# a JIT build would recompile without its objects.
if ls .gpu/jit-cache.tar.xz.* >/dev/null 2>&1; then
    mkdir -p /tmp/site/flashinfer/data/aot && cat .gpu/jit-cache.tar.xz.* | tar -xJ -C /tmp/site/flashinfer/data/aot
fi
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/machine.txt"
python3 -c "import torch, flashinfer, transformers; print('torch', torch.__version__, 'flashinfer', flashinfer.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/machine.txt"
echo "setup: $((SECONDS - start)) s"

save_cache() {
    # Only the built modules (NAME/NAME.so), not the objects: small enough to carry back.
    local stage=/tmp/jit-stage so
    rm -rf $stage && mkdir -p $stage && cp -r /tmp/site/flashinfer/data/aot/. $stage/ 2>/dev/null
    find "$FLASHINFER_WORKSPACE_BASE" -name '*.so' | while read -r so; do
        mkdir -p "$stage/$(basename "$(dirname "$so")")" && cp "$so" "$stage/$(basename "$(dirname "$so")")/"
    done
    (cd $stage && tar -c . | xz -6 -T0 | split -b 15M - "$OUT/jit-cache.tar.xz.")
    ls -la "$OUT"/jit-cache.tar.xz.* 2>/dev/null
}
trap save_cache EXIT

for step in "$@"; do
    t0=$SECONDS
    case $step in
        tests) timeout "${TESTS_TIMEOUT:-420}" python3 -m pytest -q -m gpu tests/gpu -p no:cacheprovider --timeout 300 --durations=15 2>&1 | tee "$OUT/tests.log" | tail -40 ;;
        roofline) timeout "${ROOFLINE_TIMEOUT:-300}" python3 tests/gpu/roofline.py --json "$OUT/roofline.json" ${ROOFLINE_ARGS:-} 2>&1 | grep -v 'batch\. #' | tee "$OUT/roofline.log" | tail -20 ;;
        spy-roofline)
            # Where the host spends a batch-1 decode step: py-spy's collapsed stacks (all threads).
            timeout 120 /tmp/site/bin/py-spy record --format raw --rate 500 --threads --nonblocking -o "$OUT/spy-roofline.txt" -- \
                python3 tests/gpu/roofline.py --models 1b --prefill-seqs 1 2>&1 | grep '^{' | tail -3 ;;
        spy-profile)
            timeout 150 /tmp/site/bin/py-spy record --format raw --rate 500 --threads --nonblocking -o "$OUT/spy-profile.txt" -- \
                python3 tests/gpu/profile_decode.py 2>&1 | grep '^{' | tail -3 ;;
        profile) timeout "${PROFILE_TIMEOUT:-240}" python3 tests/gpu/profile_decode.py --json "$OUT/profile.json" 2>&1 | grep -v 'batch\. #' | tee "$OUT/profile.log" | tail -8 ;;
        bench)
            # sluice bench offline vs HF generate on the same GPU and requests (dummy 1B),
            # with overlap and CUDA graphs switched off one at a time as variants.
            python3 -c "from pathlib import Path; from tests.gpu import write_model_dir; from tests.gpu.roofline import MODELS; write_model_dir(Path('/tmp/llama-1b'), **MODELS['1b'])"
            timeout "${BENCH_TIMEOUT:-300}" python3 -m app.cli bench offline --model-path /tmp/llama-1b --load-format dummy \
                --num-prompts "${BENCH_PROMPTS:-256}" --random-input-len 512 --random-output-len 256 --disable-tqdm \
                --compare-hf --hf-batch-size 32 --ab disable_overlap_schedule=true --ab disable_cuda_graph=true \
                --output-file "$OUT/bench-offline.jsonl" 2>&1 | grep -v 'batch\. #' | tee "$OUT/bench.log" | tail -45 ;;
        *) echo "unknown step $step"; exit 2 ;;
    esac
    echo "step $step: $((SECONDS - t0)) s"
done
