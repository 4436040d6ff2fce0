"""gpu_check's last step: gather every step's result into RESULTS/gpu_check.json and a Markdown
table RESULTS/gpu_check.md (printed too), for the README's "GPU" section.

    python scripts/gpu_check_report.py RESULTS_DIR
"""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path
from typing import Any, Dict, List


def _load(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _device() -> str:
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"
    except ImportError:
        return "torch missing"


def build(results: Path) -> Dict[str, Any]:
    steps = [json.loads(line) for line in (results / "steps.jsonl").read_text().splitlines() if line.strip()] \
        if (results / "steps.jsonl").exists() else []
    serve = {p.stem: _load(p) for p in sorted(results.glob("serve_*.json"))}
    bench = []
    for attention, name in (("torch_native", "bench_one_batch.json"), ("flashinfer", "bench_one_batch_flashinfer.json")):
        bench += [dict(row, attention=attention) for row in _load(results / name) or []]
    serving = None
    lines = (results / "bench_serving.jsonl").read_text().splitlines() if (results / "bench_serving.jsonl").exists() else []
    for line in reversed(lines):
        record = json.loads(line)
        if record.get("type") == "summary":
            serving = record
            break
    return dict(date=datetime.date.today().isoformat(), device=_device(), steps=steps, serve=serve,
                bench_one_batch=bench, bench_serving=serving)


def markdown(report: Dict[str, Any]) -> str:
    out: List[str] = [f"gpu_check on {report['device']}, {report['date']}", "",
                      "| step | rc | seconds |", "|---|---|---|"]
    out += [f"| {s['step']} | {s['rc']} | {s['seconds']:.0f} |" for s in report["steps"]]
    out += ["", "| serving check | prompts | identical | near ties | n=2 | ready s | passed |", "|---|---|---|---|---|---|---|"]
    for name, r in report["serve"].items():
        if r:
            out.append(f"| {name} | {r.get('prompts')} | {r.get('identical')} | {r.get('near_ties')} | "
                       f"{r.get('n2_ok')} | {r.get('candidate_ready_s')} | {r.get('passed')} |")
    if report["bench_one_batch"]:
        out += ["", "| attention | batch | input | mode | prefill tok/s | decode tok/s | step ms | x eager | % roofline |",
                "|---|---|---|---|---|---|---|---|---|"]
        for r in report["bench_one_batch"]:
            out.append(f"| {r['attention']} | {r['batch']} | {r['input']} | {r['mode']} | {r['prefill_tok_s']:,.0f} | "
                       f"{r['decode_tok_s']:,.1f} | {r['step_ms']:.2f} | {r['x_eager']:.2f} | "
                       f"{100 * r.get('roofline_fraction', 0):.0f}% |")
    s = report["bench_serving"]
    if s:
        ttft = (s.get("ttft_ms") or {}).get("median")
        out += ["", "| requests | failed | req/s | output tok/s | median TTFT ms | prefix hit rate |",
                "|---|---|---|---|---|---|",
                f"| {s.get('completed')} | {s.get('failed')} | {s.get('request_throughput', 0):.2f} | "
                f"{s.get('output_throughput', 0):.1f} | {ttft if ttft is None else round(ttft, 1)} | "
                f"{100 * s.get('server_prefix_cache_hit_rate', 0):.1f}% |"]
    return "\n".join(out) + "\n"


def main() -> int:
    results = Path(sys.argv[1])
    report = build(results)
    (results / "gpu_check.json").write_text(json.dumps(report, indent=1))
    text = markdown(report)
    (results / "gpu_check.md").write_text(text)
    print(text)
    failed = [s["step"] for s in report["steps"] if s["rc"] != 0]
    print("GPU CHECK " + ("PASSED" if not failed else f"FAILED: {', '.join(failed)}"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
