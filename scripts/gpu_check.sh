#!/usr/bin/env bash
# One prepared command for a lent CUDA machine (budget: under 8 minutes on one H200), run from
# the repo root: `bash scripts/gpu_check.sh`. Results: $OUT (or ./gpu_check_results) gets
# gpu_check.json and gpu_check.md, plus the logs.
#
# Packages that machine lacks travel in .whl/, filled by scripts/pack_gpu_wheels.sh: wheels, and
# flashinfer as one .whl/*.tar.xz unpacked here (a wheel in parts, .whl/NAME.part-*, is joined).
# Steps, each timed and recorded, the FlashInfer ones last (their kernels JIT-compile on first
# use, minutes), so the torch_native results come back even when those run out of time:
#   1. the `gpu` pytest marker suite (the files that hold gpu tests; FlashInfer's apart)
#   2. launch_server --device cuda on the tiny Llama and Qwen3 models vs the CPU fp32 reference
#      (32 greedy prompts, shared prefix, chunked prefill, page 16, n = 2, logprobs): fp32 exact,
#      bf16 within the near-tie rule (scripts/gpu_serving_check.py)
#   3. bench_one_batch.py: ~1B Llama, dummy weights, bf16, decode at batch 1/8/64 eager vs graph,
#      prefill at 2,048 tokens, with the 4.8 TB/s roofline
#   4. bench_serving.py: 256 shared-prefix requests at concurrency 64 against the CUDA server
#   5. when flashinfer imports: its gpu tests, then the serving check and bench_one_batch with
#      --attention-backend flashinfer
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
RESULTS=${OUT:-$PWD/gpu_check_results}
mkdir -p "$RESULTS"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

# --- 0. the first CUDA check: say so plainly when there is no GPU ---------------------------
if ! "$PY" - <<'PYEOF'
import sys
try:
    import torch
except ImportError as exc:
    sys.exit(f"gpu_check: no CUDA device: torch is not importable ({exc}).")
if not torch.cuda.is_available():
    sys.exit(f"gpu_check: no CUDA device: torch {torch.__version__} sees no GPU "
             "(torch.cuda.is_available() is False). Run this on a CUDA machine; on CPU the GPU path is "
             "covered by tests/test_device_discipline.py and tests/test_cuda_graph_runner.py.")
print(f"gpu_check: torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}")
PYEOF
then
    exit 2
fi

# --- carried wheels -----------------------------------------------------------------------
if [ -d .whl ]; then
    for first in .whl/*.part-aa; do
        [ -e "$first" ] || continue
        whole="${first%.part-aa}"
        cat "${whole}".part-* > "$whole" && echo "gpu_check: joined $(basename "$whole")"
    done
    if compgen -G ".whl/*.whl" > /dev/null; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            .whl/*.whl || { echo "gpu_check: FAILED to install the carried wheels"; exit 1; }
    fi
    for archive in .whl/*.tar.xz; do
        [ -e "$archive" ] || continue
        mkdir -p /tmp/site && tar -xJf "$archive" -C /tmp/site \
            || { echo "gpu_check: FAILED to unpack $archive"; exit 1; }
        echo "gpu_check: unpacked $(basename "$archive")"
    done
    export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
"$PY" -c "import zmq, orjson, setproctitle" 2>/dev/null \
    || { echo "gpu_check: pyzmq, orjson and setproctitle are needed (carry them in .whl/)"; exit 1; }
HAVE_FI=0
"$PY" -c "import flashinfer" 2>/dev/null && HAVE_FI=1
echo "gpu_check: flashinfer importable: $HAVE_FI"

STEPS="$RESULTS/steps.jsonl"
: > "$STEPS"
step() {  # step NAME TIMEOUT_S CMD...: run, time and record one step (never stops the script)
    local name=$1 limit=$2; shift 2
    local t0=$(date +%s)
    echo "== $name"
    timeout "$limit" "$@" > "$RESULTS/$name.log" 2>&1
    local rc=$?
    local secs=$(( $(date +%s) - t0 ))
    tail -n 25 "$RESULTS/$name.log"
    printf '{"step": "%s", "rc": %d, "seconds": %.1f}\n' "$name" "$rc" "$secs" >> "$STEPS"
    echo "== $name: rc=$rc in ${secs} s"
}

# The CPU fp32 reference servers use the C++ CPU kernels: build them (once per machine) while
# the gpu tests run, so no serving step spends its time limit compiling.
"$PY" kernels/cpu/build.py > "$RESULTS/cpu_kernels_build.log" 2>&1 &
BUILD_PID=$!

MODELS=/tmp/gpu_check_models
"$PY" scripts/make_tiny_model.py --arch llama --out "$MODELS/llama" > /dev/null 2>&1
"$PY" scripts/make_tiny_model.py --arch qwen3 --out "$MODELS/qwen3" > /dev/null 2>&1

# Only the files that hold gpu tests: collecting the whole suite would import test-only packages
# (openai, jsonschema, gguf) that the CUDA machine does not have.
step pytest_gpu 150 "$PY" -m pytest -m gpu -q -rs -p no:cacheprovider \
    $(grep -l "mark.gpu" tests/test_*.py | grep -v flashinfer)
wait "$BUILD_PID"; echo "gpu_check: CPU kernels build rc=$? ($(tail -n 1 "$RESULTS/cpu_kernels_build.log"))"
for arch in llama qwen3; do
    for dtype in float32 bfloat16; do
        step "serve_${arch}_${dtype}" 120 "$PY" scripts/gpu_serving_check.py --model-path "$MODELS/$arch" \
            --device cuda --dtype "$dtype" --attention-backend torch_native --json-out "$RESULTS/serve_${arch}_${dtype}.json" \
            --log-dir "$RESULTS/logs"
    done
done
step bench_one_batch 200 "$PY" scripts/bench_one_batch.py --preset llama-1b --dtype bfloat16 --device cuda --no-hf \
    --decode-modes eager graph --batch-sizes 1 8 64 --input-lens 2048 --output-len 32 \
    --json-out "$RESULTS/bench_one_batch.json"
step bench_serving 200 "$PY" scripts/gpu_bench_serving.py --model-path "$MODELS/llama" --results "$RESULTS"
if [ "$HAVE_FI" = 1 ]; then
    step pytest_flashinfer 300 "$PY" -m pytest -m gpu -q -rs -p no:cacheprovider tests/test_flashinfer_backend.py
    step serve_llama_bf16_flashinfer 240 "$PY" scripts/gpu_serving_check.py --model-path "$MODELS/llama" \
        --device cuda --dtype bfloat16 --attention-backend flashinfer --json-out "$RESULTS/serve_llama_bf16_flashinfer.json" \
        --log-dir "$RESULTS/logs"
    step bench_one_batch_flashinfer 200 "$PY" scripts/bench_one_batch.py --preset llama-1b --dtype bfloat16 \
        --device cuda --no-hf --attention-backend flashinfer --decode-modes eager graph --batch-sizes 1 8 64 \
        --input-lens 2048 --output-len 32 --json-out "$RESULTS/bench_one_batch_flashinfer.json"
fi

"$PY" scripts/gpu_check_report.py "$RESULTS"
