"""The start-up arithmetic and errors know about tensor parallelism: per-rank KV heads, a
--tp-size the model cannot split, and which --tp-size would admit an input on GPUs."""

from __future__ import annotations

import subprocess
import sys

from server_utils import REPO_ROOT, server_env
from srt.check_config_target import SizingInputs, tp_alternative
from test_check_config import check_json, run_module

GiB = 1 << 30


def test_tp2_halves_each_ranks_kv_cell_and_weights(llama_model):
    _, one = check_json(llama_model, "--max-total-tokens", "1000")
    _, two = check_json(llama_model, "--max-total-tokens", "1000", "--tp-size", "2")
    assert two["cell_size"] * 2 == one["cell_size"]  # 2 KV heads -> 1 per rank
    assert two["weight_bytes_per_rank"] == one["weight_bytes"] // 2 and two["tp_size"] == 2
    assert two["mem_fraction_static"] == one["mem_fraction_static"] / 2  # CPU ranks share host RAM


def test_tp_size_the_model_cannot_split_names_the_numbers_and_valid_sizes(llama_model):
    done = run_module("srt.check_config", llama_model, "--tp-size", "3")
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("--tp-size 3 does not fit this model: num_attention_heads 4 is not divisible by it")
    assert last.endswith("Valid --tp-size values: 1, 2, 4."), last
    served = subprocess.run([sys.executable, "-m", "srt.launch_server", "--model-path", str(llama_model),
                             "--device", "cpu", "--tp-size", "3", "--max-total-tokens", "1000"],
                            cwd=REPO_ROOT, env=server_env(), capture_output=True, text=True, timeout=180)
    assert served.returncode == 1
    line = (served.stdout + served.stderr).strip().splitlines()[-1]
    assert line.startswith("--tp-size 3 does not fit this model") and "Valid --tp-size values: 1, 2, 4." in line
    assert "Traceback" not in served.stderr


def test_tp_alternative_is_the_smallest_size_that_fits_each_gpu():
    weights, cell1 = 60 * GiB, 160 * 1024

    def cell_at(t):
        return cell1 // t

    inputs = SizingInputs(pre=80 * GiB, avail=80 * GiB - weights, fraction=0.9, cell=cell1, page_size=16,
                          context_len=131072, max_total_tokens=None, max_running_requests=None, device_kind="cuda")
    assert not inputs.admits(100_000)
    alt = tp_alternative(100_000, inputs, weights, 1, [1, 2, 4, 8], cell_at)
    assert alt["tp_size"] == 2 and "--tp-size 2" in alt["text"]
    assert tp_alternative(100_000, inputs, weights, 1, [1, 4, 8], cell_at)["tp_size"] == 4
    assert tp_alternative(10_000_000, inputs, weights, 1, [1, 2, 4, 8], cell_at) is None


def test_more_ranks_than_gpus_is_refused_with_the_counts():
    import pytest

    from srt.distributed.tp_config import check_gpu_count
    from srt.server_args import ServerArgs

    args = ServerArgs(device="cpu", tp_size=4, dp_size=2)
    check_gpu_count(args, 8)
    with pytest.raises(ValueError) as err:
        check_gpu_count(args, 2, "0,1")
    assert str(err.value).startswith("--tp-size 4 x --dp-size 2 needs 8 GPUs on this node (one per rank), but "
                                     "torch sees 2 (CUDA_VISIBLE_DEVICES=0,1).")
