"""Engine lifecycle: two engines in sequence, clean shutdown, a dying scheduler is reported."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from srt.entrypoints.engine import Engine, EngineDeadError

KW = dict(dtype="float32", device="cpu", max_total_tokens=8192)


def _runtime_children():
    """Our children, minus multiprocessing's resource tracker (one per parent, by design)."""
    return {c.pid for c in psutil.Process().children(recursive=True)
            if "resource_tracker" not in " ".join(c.cmdline())}


def test_two_engines_in_sequence_and_clean_shutdown(llama_model):
    before = _runtime_children()
    for _ in range(2):
        eng = Engine(model_path=str(llama_model), **KW)
        ipc_dir = eng.procs.port_args.tmpdir
        assert os.path.isdir(ipc_dir)
        assert eng.generate("Hello", {"max_new_tokens": 3, "temperature": 0})["meta_info"]["completion_tokens"] == 3
        eng.shutdown()
        assert not os.path.exists(ipc_dir)
    time.sleep(0.5)
    assert _runtime_children() - before == set()


def test_killed_scheduler_is_reported_to_callers(llama_model):
    eng = Engine(model_path=str(llama_model), **KW)
    try:
        os.kill(eng.get_server_info()["pids"]["Scheduler"], 9)
        deadline = time.time() + 5
        while eng.dead_reason is None and time.time() < deadline:
            time.sleep(0.05)
        assert eng.dead_reason and "Scheduler process" in eng.dead_reason and "SIGKILL" in eng.dead_reason
        with pytest.raises(EngineDeadError, match="SIGKILL"):
            eng.generate("Hello", {"max_new_tokens": 2})
    finally:
        eng.shutdown()


def test_front_process_exits_nonzero_with_cause_when_scheduler_dies(llama_model, tmp_path):
    script = tmp_path / "front.py"
    script.write_text(textwrap.dedent(f"""
        import os, time
        from srt.entrypoints.engine import Engine
        eng = Engine(model_path={str(llama_model)!r}, exit_on_child_death=True, dtype="float32",
                     device="cpu", max_total_tokens=8192)
        print("READY", eng.get_server_info()["pids"]["Scheduler"], flush=True)
        time.sleep(60)
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line.startswith("READY"), proc.stderr.read()
    os.kill(int(line.split()[1]), 9)
    t0 = time.time()
    rc = proc.wait(timeout=10)
    assert time.time() - t0 < 5
    err = proc.stderr.read().strip().splitlines()
    assert rc != 0
    assert "Scheduler process" in err[-1] and "SIGKILL" in err[-1]


def test_bad_model_path_fails_before_spawning(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        Engine(model_path=str(tmp_path / "nope"))
