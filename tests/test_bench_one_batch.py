"""scripts/bench_one_batch.py --decode-attention on the CPU: the shared-prefix batch it builds
(groups whose requests hold one prefix's slots) runs every implementation and gives every slot back."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels.cpu.paged_attention import paged_decode_op

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_one_batch.py"


@pytest.mark.skipif(paged_decode_op("cpu", torch.float32, torch.float32) is None,
                    reason="the C++ CPU kernels did not build here")
def test_shared_prefix_decode_attention_rows_for_every_implementation() -> None:
    cmd = [sys.executable, str(SCRIPT), "--preset", "tiny", "--no-hf", "--batch-sizes", "5", "--input-lens", "300",
           "--output-len", "2", "--decode-attention", "paged", "paged-unshared", "paged-fp32-tiles", "torch",
           "--random-prompt-kv",
           "--shared-prefix", "260", "2", "--threads", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    # A leaked or doubly freed slot raises after the batch is released (the script checks the pool).
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 groups sharing their first 260 slots" in proc.stdout
    rows = [line for line in proc.stdout.splitlines() if re.match(r"\| 5 \| 300 \|", line)]
    assert len(rows) == 1, proc.stdout
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    times = [float(c) for c in cells[2:10]]  # step and CPU ms for paged, paged-unshared, paged-fp32-tiles, torch
    assert len(times) == 8 and all(t > 0 for t in times), rows[0]


def _mode_rows(stdout: str) -> dict:
    """`--decode-modes` rows of batch 2 x input 16: mode -> its numeric cells, in printed order."""
    rows = {}
    for line in stdout.splitlines():
        m = re.match(r"\| 2 \| 16 \| (\w+) \|", line)
        if m:
            rows[m.group(1)] = [float(c.replace(",", "")) for c in line.strip("|").split("|")[3:]]
    return rows


def test_decode_modes_eager_and_compile_rows_on_cpu() -> None:
    """`--decode-modes eager compile` on CPU: the compiled forward runs over weights left unpacked,
    as --enable-torch-compile leaves them (over oneDNN's packed weights it raised while tracing)."""
    cmd = [sys.executable, str(SCRIPT), "--preset", "tiny", "--no-hf", "--device", "cpu", "--batch-sizes", "2",
           "--input-lens", "16", "--output-len", "3", "--decode-modes", "eager", "compile", "--threads", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "CPU weights unpacked as under --enable-torch-compile" in proc.stdout
    rows = _mode_rows(proc.stdout)
    assert sorted(rows) == ["compile", "eager"], proc.stdout
    assert rows["eager"][-1] == 1.0  # the ratio column is against eager
    assert all(v > 0 for cells in rows.values() for v in cells), rows


def test_thin_30_preset_is_smollm2_depth_with_little_arithmetic(tmp_path: Path) -> None:
    """`--preset thin-30` measures a 30-layer model's fixed cost per step: SmolLM2-135M's depth,
    a consistent tiny shape (heads x head_dim = hidden), and it runs end to end."""
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("bench_one_batch_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cfg = json.loads((module.write_preset("thin-30", tmp_path, 512) / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 30
    assert cfg["num_attention_heads"] * cfg["head_dim"] == cfg["hidden_size"] == 64
    assert cfg["num_attention_heads"] % cfg["num_key_value_heads"] == 0

    cmd = [sys.executable, str(SCRIPT), "--preset", "thin-30", "--no-hf", "--batch-sizes", "2", "--input-lens", "8",
           "--output-len", "3", "--threads", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if re.match(r"\| 2 \| 8 \|", line)]
    assert len(rows) == 1, proc.stdout
    step_ms = float(rows[0].strip("|").split("|")[-1].replace(",", ""))
    assert step_ms > 0, rows[0]


def test_decode_modes_modules_and_eager_rows_on_cpu() -> None:
    """`--decode-modes modules eager`: the module tree's decode and the CPU decode runner's, with
    the ratio column against eager even when eager is measured second."""
    cmd = [sys.executable, str(SCRIPT), "--preset", "tiny", "--no-hf", "--device", "cpu", "--batch-sizes", "2",
           "--input-lens", "16", "--output-len", "3", "--decode-modes", "modules", "eager", "--threads", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _mode_rows(proc.stdout)
    assert list(rows) == ["modules", "eager"], proc.stdout
    assert rows["eager"][-1] == 1.0
    # From the tok/s cells: a step of a few tenths of a millisecond, printed to 0.01 ms, is too coarse.
    assert rows["modules"][-1] == pytest.approx(rows["modules"][1] / rows["eager"][1], abs=0.01)


def test_a_preset_against_hf_loads_the_same_weights_into_ours() -> None:
    """The default run (a preset with the HF side): HF's seeded init is saved and loaded by ours
    (copying it into the model after start-up failed once the CPU weights were packed)."""
    cmd = [sys.executable, str(SCRIPT), "--preset", "tiny", "--device", "cpu", "--batch-sizes", "2",
           "--input-lens", "16", "--output-len", "3", "--threads", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| 2 | 16 |")]
    assert len(rows) == 1, proc.stdout
    cells = [float(c.replace(",", "")) for c in rows[0].strip("|").split("|")[2:]]
    assert len(cells) == 7 and all(v > 0 for v in cells), rows[0]  # ours, HF and the ratios
