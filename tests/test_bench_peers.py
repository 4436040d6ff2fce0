"""scripts/bench_peers.py without servers: ratios, rows, the table, sizes and bench_serving argv."""

from __future__ import annotations

import json

import pytest

from tiny_models import REPO_ROOT, load_script


@pytest.fixture(scope="module")
def bp():
    return load_script(REPO_ROOT / "scripts" / "bench_peers.py")


def summary(tok_s: float, ttft_ms: float, hit=None, completed=4, failed=0, out=64, expected=64) -> dict:
    return {"output_throughput": tok_s, "ttft_ms": {"median": ttft_ms}, "server_prefix_cache_hit_rate": hit,
            "completed": completed, "failed": failed, "total_output_tokens": out, "expected_output_tokens": expected}


def test_ratio_is_ours_over_peer_and_dashes_missing_or_zero(bp):
    assert bp.ratio(30.0, 10.0) == "3.00x"
    assert bp.ratio(5.0, 20.0) == "0.25x"
    assert bp.ratio(None, 10.0) == bp.ratio(10.0, None) == bp.ratio(10.0, 0.0) == "-"


def test_rows_compare_each_peer_with_ours_on_the_same_workload_and_dtype(bp):
    results = {
        ("random", "fp32", "ours"): summary(100.0, 50.0, hit=0.0),
        ("random", "fp32", "transformers"): summary(50.0, 200.0),
        ("random", "bf16", "ours"): summary(80.0, 40.0, hit=0.25),
        ("random", "bf16", "transformers"): summary(160.0, 20.0),
    }
    rows = {tuple(r[:3]): r for r in bp.build_rows(results)}
    assert rows[("random", "fp32", "transformers")][-2:] == ["2.00x", "0.25x"]
    assert rows[("random", "bf16", "transformers")][-2:] == ["0.50x", "2.00x"]
    assert rows[("random", "fp32", "ours")][-2:] == ["-", "-"]
    assert rows[("random", "bf16", "ours")][7] == "0.250"
    assert rows[("random", "fp32", "transformers")][7] == "n/a"


def test_rows_keep_failed_servers_and_report_counts(bp):
    results = {
        ("multi-turn", "fp32", "ours"): summary(10.0, 5.0, hit=0.5, completed=7, failed=1, out=100, expected=128),
        ("multi-turn", "fp32", "llama.cpp"): None,
    }
    ours, peer = bp.build_rows(results)
    assert ours[3:5] == ["7/8", "100/128"]
    assert peer[:4] == ["multi-turn", "fp32", "llama.cpp", "failed"]
    assert set(peer[4:]) == {"-"}


def test_table_is_markdown_with_one_line_per_row(bp):
    table = bp.format_table([["random", "fp32", "ours"] + ["x"] * (len(bp.HEADER) - 3)])
    lines = table.splitlines()
    assert lines[0].startswith("| workload | dtype | server |") and lines[1] == "|" + "---|" * len(bp.HEADER)
    assert lines[2] == "| random | fp32 | ours | " + " | ".join(["x"] * (len(bp.HEADER) - 3)) + " |"


def test_full_sizes_are_the_issue_defaults_and_quick_fits_the_demo_context(bp):
    full, quick = bp.Sizes(), bp.Sizes.quick()
    gsp = (full.gsp_groups, full.gsp_per_group, full.gsp_system, full.gsp_question, full.gsp_output)
    assert gsp == (8, 8, 1024, 64, 32)
    assert (full.mt_conversations, full.mt_turns, full.concurrency) == (16, 4, 16)
    assert (full.random_input_min, full.random_input_max, full.random_output) == (64, 512, 64)
    assert max(quick.longest(w) for w in bp.WORKLOADS) <= 512  # srt/demo_model's context


def test_bench_argv_is_accepted_by_bench_serving(bp):
    for workload in bp.WORKLOADS:
        args = bp.bs.parse_args(bp.bench_argv(workload, bp.Sizes(), "http://127.0.0.1:1234"))
        assert args.backend == "openai" and args.dataset_name == workload and args.max_concurrency == 16
    args = bp.bs.parse_args(bp.bench_argv("random", bp.Sizes(), "http://127.0.0.1:1234"))
    assert int(args.random_input_len * args.random_range_ratio) == 64 and args.random_input_len == 512


def test_transformers_requests_disable_eos_without_fields_it_refuses(bp):
    args = bp.bs.parse_args(bp.bench_argv("random", bp.Sizes(), "http://127.0.0.1:1234"))
    ours = bp.PeerClient(args, None, "m", "ours")._payload(" a b", 8)
    theirs = bp.PeerClient(args, None, "m", "transformers")._payload(" a b", 8)
    assert ours["ignore_eos"] is True and "generation_config" not in ours
    assert "ignore_eos" not in theirs  # transformers serve answers 422 to fields outside the OpenAI schema
    assert json.loads(theirs["generation_config"]) == {"do_sample": False, "eos_token_id": -1}
    assert theirs["max_tokens"] == 8 and theirs["temperature"] == 0.0


def test_tokens_are_counted_per_chunk_until_usage_gives_the_total(bp):
    args = bp.bs.parse_args(bp.bench_argv("random", bp.Sizes(), "http://127.0.0.1:1234"))
    client, record = bp.PeerClient(args, None, "m", "llama.cpp"), bp.bs.Record(0, 0)
    for text in ("a", "", "b"):
        client._absorb({"choices": [{"text": text}]}, record)
    assert record.output_tokens == 2
    client._absorb({"choices": [{"text": ""}], "usage": {"prompt_tokens": 5, "completion_tokens": 3}}, record)
    assert (record.output_tokens, record.prompt_tokens) == (3, 5)


def test_llama_cpp_tree_is_read_from_the_build_cache_else_above_an_in_tree_build(bp, tmp_path):
    out_of_tree = tmp_path / "build" / "bin" / "llama-server"
    out_of_tree.parent.mkdir(parents=True)
    out_of_tree.touch()
    (tmp_path / "build" / "CMakeCache.txt").write_text("X:STRING=1\nCMAKE_HOME_DIRECTORY:INTERNAL=/src/llama.cpp\n")
    assert str(bp.llama_source_dir(out_of_tree)) == "/src/llama.cpp"
    in_tree = tmp_path / "llama.cpp" / "build" / "bin" / "llama-server"
    in_tree.parent.mkdir(parents=True)
    in_tree.touch()
    assert bp.llama_source_dir(in_tree) == (tmp_path / "llama.cpp").resolve()


def test_repeated_rounds_give_medians_and_the_median_of_paired_ratios(bp):
    # Round 2 ran on a slow machine for both: its pair still says 2x, and the median ratio is
    # the paired one (2.00x), not the ratio of the medians (90 / 40 = 2.25x).
    results = {
        ("random", "bf16", "ours"): [summary(100.0, 10.0, hit=0.0), summary(40.0, 30.0, hit=0.0),
                                     summary(90.0, 20.0, hit=0.0)],
        ("random", "bf16", "transformers"): [summary(40.0, 40.0), summary(20.0, 60.0), summary(50.0, 50.0)],
    }
    rows = {r[2]: r for r in bp.build_rows(results)}
    ours, peer = rows["ours"], rows["transformers"]
    assert ours[3:6] == ["12/12", "192/192", "90.0 (40.0-100.0)"]
    assert ours[6] == "20" and ours[7] == "0.000"
    assert peer[5] == "40.0 (20.0-50.0)" and peer[6] == "50"
    assert peer[8] == "2.00x"  # per-round ratios 2.5, 2.0, 1.8
    assert peer[9] == "0.40x"  # per-round TTFT ratios 0.25, 0.5, 0.4


def test_a_failed_round_drops_its_pair_and_is_counted(bp):
    results = {
        ("random", "fp32", "ours"): [summary(60.0, 10.0), None],
        ("random", "fp32", "transformers"): [summary(20.0, 40.0), summary(10.0, 10.0)],
    }
    ours, peer = bp.build_rows(results)
    assert ours[3] == "4/4 (1 runs failed)" and ours[5] == "60.0 (60.0-60.0)"
    assert peer[8] == "3.00x"  # only round 1 has both servers


def test_repeats_alternate_the_order_of_the_servers(bp, monkeypatch, tmp_path, capsys):
    calls = []
    monkeypatch.setattr(bp, "resolve_model", lambda name: tmp_path)
    monkeypatch.setattr(bp, "check_context", lambda model, opts: None)
    monkeypatch.setattr(bp, "run_one", lambda w, d, name, model, opts, rnd=None: calls.append((name, rnd))
                        or summary(10.0, 1.0))
    assert bp.main(["--workloads", "random", "--dtypes", "bf16", "--servers", "ours", "transformers",
                    "--repeats", "3", "--log-dir", str(tmp_path)]) == 0
    assert calls == [("ours", 0), ("transformers", 0), ("transformers", 1), ("ours", 1), ("ours", 2),
                     ("transformers", 2)]
    assert capsys.readouterr().out.splitlines()[-1] == "KV cache under bf16 weights: ours bf16, transformers bf16"
    with pytest.raises(SystemExit):
        bp.parse_args(["--repeats", "0"])


def test_kv_cache_dtypes_say_what_each_server_stores(bp, tmp_path):
    opts = bp.parse_args(["--servers", "ours", "transformers", "--dtypes", "fp32", "--log-dir", str(tmp_path)])
    assert bp.kv_cache_dtypes(opts, "fp32") == {"ours": "fp32", "transformers": "fp32"}
    opts.servers, opts.our_args = ["ours", "llama.cpp"], "--kv-cache-dtype bf16"
    assert bp.kv_cache_dtypes(opts, "fp32") == {"ours": "bf16", "llama.cpp": "f16"}  # llama-server's default
    opts.our_args, opts.llama_args = "--kv-cache-dtype=auto", "-t 2 -ctk f32 --cache-type-v=f32"
    assert bp.kv_cache_dtypes(opts, "bf16") == {"ours": "bf16", "llama.cpp": "f32"}
    opts.llama_args = "-ctk q8_0"
    assert bp.kv_cache_dtypes(opts, "fp32")["llama.cpp"] == "K q8_0 / V f16"
