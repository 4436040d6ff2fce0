"""Cost of grammar-constrained decoding: decode tok/s of 32 constrained vs 32 unconstrained
requests on the same scheduler, side by side in one run, and the host time spent filling the
masks per decode step.

    python scripts/bench_constrained.py --model-path DIR [--batch 32] [--new-tokens 48]

Constrained requests use a JSON schema (nested object, enum, bounded strings and arrays) at
temperature 1.0; unconstrained ones the same sampling without it. Both decode at most
--new-tokens tokens (ignore_eos: unconstrained ones run to the limit, constrained ones end where
their JSON closes); only steps with the whole batch running are timed.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from managers.io_struct import TokenizedGenerateReqInput  # noqa: E402
from managers.schedule_batch import ScheduleBatch  # noqa: E402
from managers.scheduler import Scheduler  # noqa: E402
from srt.model_executor.model_runner import ModelRunner  # noqa: E402
from srt.sampling.sampling_params import SamplingParams  # noqa: E402
from srt.server_args import ServerArgs  # noqa: E402
from srt.utils.hf_transformers_utils import get_tokenizer  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12}, "kind": {"enum": ["cat", "dog", "owl"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 4},
    "owner": {"type": "object", "properties": {"id": {"type": "integer"}, "vip": {"type": "boolean"}},
              "required": ["id", "vip"]}}, "required": ["name", "kind", "owner"]}


def run(sched: Scheduler, constrained: bool, batch: int, new_tokens: int, vocab: int):
    timings, mask_times = [], []
    real_mask = ScheduleBatch._with_grammar_mask

    def timed_mask(self, info):
        t0 = time.perf_counter()
        out = real_mask(self, info)
        if info.vocab_mask is not None and self.forward_mode.is_decode():
            mask_times.append(time.perf_counter() - t0)
        return out

    ScheduleBatch._with_grammar_mask = timed_mask
    extra = {"json_schema": json.dumps(SCHEMA)} if constrained else {}
    for i in range(batch):
        params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True, **extra)
        sched.process_input(TokenizedGenerateReqInput(f"{constrained}-{i}", [5 + i % 50, 17, 230, 41], params))
    try:
        while sched.waiting_queue or not sched.running_batch.is_empty():
            decoding = not sched.running_batch.is_empty() and not sched.waiting_queue
            n = len(sched.running_batch.reqs)
            t0 = time.perf_counter()
            sched.step()
            if decoding and n == batch:
                timings.append(time.perf_counter() - t0)
    finally:
        ScheduleBatch._with_grammar_mask = real_mask
    return timings, mask_times


def main() -> int:
    logging.basicConfig(level=logging.WARNING)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", required=True)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=48)
    args = p.parse_args()
    sa = ServerArgs(model_path=args.model_path, device="cpu", dtype="float32")
    runner = ModelRunner(sa, max_total_tokens=16384, max_running_requests=args.batch)
    tok = get_tokenizer(args.model_path)
    sched = Scheduler(sa, runner, tokenizer=tok)
    vocab = runner.model_config.vocab_size
    sched.grammars.backend.compile_now(("json", json.dumps(SCHEMA)))  # compile outside the timing
    run(sched, False, args.batch, 4, vocab)  # warm-up
    rows = {}
    for constrained in (False, True):
        steps, masks = run(sched, constrained, args.batch, args.new_tokens, vocab)
        rows[constrained] = (statistics.median(steps), statistics.median(masks) if masks else 0.0, len(steps))
    base, cons = rows[False][0], rows[True][0]
    print(f"# bench_constrained: {args.model_path}, cpu fp32, batch {args.batch}, vocab {vocab}, llguidance, "
          f"JSON schema, temperature 1.0; medians over full-batch decode steps")
    print("| requests | decode step ms | decode tok/s | mask fill ms per step | steps | extra per step |")
    print("|---|---|---|---|---|---|")
    for constrained, (step, mask, n) in rows.items():
        label = f"{args.batch} constrained" if constrained else f"{args.batch} unconstrained"
        extra = f"{100 * (step / base - 1):+.1f}%" if constrained else ""
        print(f"| {label} | {step * 1e3:.2f} | {args.batch / step:,.0f} | {mask * 1e3:.3f} | {n} | {extra} |")
    return 0 if cons > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
