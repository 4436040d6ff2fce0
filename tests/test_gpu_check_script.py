"""`scripts/gpu_check.sh` and its helpers on a CPU machine: the script stops at its first CUDA
check with a plain message; the serving check's comparison and report work on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

import gpu_check_report  # noqa: E402
import gpu_serving_check  # noqa: E402


def test_gpu_check_exits_at_the_first_cuda_check_with_a_clear_message(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable, OUT=str(tmp_path))
    proc = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh")], capture_output=True, text=True,
                          env=env, timeout=120)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 2, text
    assert "gpu_check: no CUDA device" in text and "torch.cuda.is_available() is False" in text
    assert "Traceback" not in text
    assert not (tmp_path / "steps.jsonl").exists(), "nothing after the CUDA check may run"


def _out(ids, top=None):
    return {"output_ids": ids, "meta_info": {"output_top_logprobs": top or [[[-0.1, i], [-3.0, 0]] for i in ids]}}


def _runs(ref_ids, cand_ids, ref_top=None):
    ref = {"batch": [_out(ref_ids, ref_top)], "n2": [_out([1]), _out([1])]}
    cand = {"batch": [_out(cand_ids)], "n2": [_out([1]), _out([1])]}
    return ref, cand


def test_near_tie_rule_accepts_a_top_k_choice_within_tie_nats_in_low_precision_only():
    tie_top = [[[-0.1, 5], [-0.2, 6]], [[-0.1, 7], [-2.0, 1]]]
    ref, cand = _runs([5, 7], [6, 9], tie_top)
    assert gpu_serving_check.compare(ref, cand, exact=False, tie_nats=0.25)["passed"]
    assert not gpu_serving_check.compare(ref, cand, exact=True, tie_nats=0.25)["passed"]
    assert not gpu_serving_check.compare(ref, cand, exact=False, tie_nats=0.05)["passed"]
    three_way = [[[-0.1, 5], [-0.1001, 8], [-0.15, 6]], [[-0.1, 7], [-2.0, 1]]]
    ref, cand = _runs([5, 7], [6, 9], three_way)  # the reference's third choice, still a near tie
    assert gpu_serving_check.compare(ref, cand, exact=False, tie_nats=0.25)["near_ties"] == 1
    far_top = [[[-0.1, 5], [-1.5, 6]], [[-0.1, 7], [-2.0, 1]]]
    ref, cand = _runs([5, 7], [6, 9], far_top)
    result = gpu_serving_check.compare(ref, cand, exact=False, tie_nats=0.25)
    assert not result["passed"] and result["failures"][0]["position"] == 0
    ref, cand = _runs([5, 7], [4, 9], tie_top)  # a token outside the reference's top: a failure
    assert not gpu_serving_check.compare(ref, cand, exact=False, tie_nats=0.25)["passed"]
    ref, cand = _runs([5, 7], [5, 7])
    cand["n2"] = [_out([1]), _out([2])]
    assert not gpu_serving_check.compare(ref, cand, exact=True, tie_nats=0.25)["n2_ok"]


def test_serving_check_self_check_on_cpu_passes(llama_model, tmp_path):
    out = tmp_path / "serve.json"
    rc = gpu_serving_check.main(["--model-path", str(llama_model), "--device", "cpu", "--dtype", "float32",
                                 "--json-out", str(out), "--log-dir", str(tmp_path)])
    result = json.loads(out.read_text())
    assert rc == 0, result
    assert result["identical"] == result["prompts"] == 32 and result["n2_ok"]


def test_report_collects_steps_and_tables(tmp_path):
    (tmp_path / "steps.jsonl").write_text('{"step": "pytest_gpu", "rc": 0, "seconds": 12.0}\n'
                                          '{"step": "bench_serving", "rc": 1, "seconds": 3.0}\n')
    (tmp_path / "serve_llama_float32.json").write_text(json.dumps(
        dict(prompts=32, identical=32, near_ties=0, n2_ok=True, candidate_ready_s=9.5, passed=True)))
    (tmp_path / "bench_one_batch.json").write_text(json.dumps([dict(
        batch=1, input=2048, mode="graph", prefill_tok_s=1e4, decode_tok_s=300.0, step_ms=3.3, x_eager=2.5,
        roofline_fraction=0.6)]))
    (tmp_path / "bench_one_batch_flashinfer.json").write_text(json.dumps([dict(
        batch=8, input=2048, mode="eager", prefill_tok_s=2e4, decode_tok_s=900.0, step_ms=8.9, x_eager=1.0,
        roofline_fraction=0.06)]))
    report = gpu_check_report.build(tmp_path)
    text = gpu_check_report.markdown(report)
    assert "| serve_llama_float32 | 32 | 32 | 0 | True | 9.5 | True |" in text
    assert "| torch_native | 1 | 2048 | graph | 10,000 | 300.0 | 3.30 | 2.50 | 60% |" in text
    assert "| flashinfer | 8 | 2048 | eager | 20,000 | 900.0 | 8.90 | 1.00 | 6% |" in text
    assert "| bench_serving | 1 | 3 |" in text
