#!/usr/bin/env bash
# One-shot check for a lent CUDA machine, run from anywhere: `bash scripts/gpu_check.sh`.
# With flashinfer importable: every `gpu` test (FlashInfer backend vs the torch oracle, and the
# rest). Without it: the torch_native backend and the FlashInfer page table on CUDA vs CPU.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

"$PY" - <<'PYEOF' || exit 1
import torch
assert torch.cuda.is_available(), "no CUDA device visible to torch"
print(f"torch {torch.__version__} on {torch.cuda.get_device_name(0)}")
PYEOF
if ! "$PY" -c "import pytest" 2>/dev/null; then
    echo "FAILED: pytest is not installed for $PY (it is pure Python: carry it on PYTHONPATH)"
    exit 1
fi

if "$PY" -c "import flashinfer" 2>/dev/null; then
    echo "== flashinfer $("$PY" -c 'import flashinfer; print(flashinfer.__version__)') found"
    echo "== verifying: FlashInfer extend/decode vs torch_native (page 1/16, GQA 1/4, bf16/fp16, fp8 KV),"
    echo "   page table and torch_native on CUDA vs CPU, and every other gpu test"
    "$PY" -m pytest -m gpu -q -rs tests/
else
    echo "== flashinfer NOT installed: FlashInfer kernels are NOT verified here"
    echo "== verifying: torch_native backend on CUDA vs CPU (extend + decode, page 1/16, fp32/bf16)"
    echo "   and the FlashInfer page table built on CUDA vs CPU"
    "$PY" -m pytest -m gpu -q -rs tests/test_flashinfer_backend.py \
        -k "torch_native_on_cuda or page_table_built_on_cuda"
fi
rc=$?
[ "$rc" -eq 0 ] && echo "GPU CHECK PASSED" || echo "GPU CHECK FAILED (pytest exit $rc)"
exit "$rc"
