"""The cost of a verify step: forward time over n new tokens, t(n), on SmolLM2-135M int4, at a short and a long
context. A verify step over n tokens (the last token and n - 1 drafts) emits at most n tokens, so speculation that
verifies n tokens a step is bounded by n t(1) / t(n) (`bound` below), whatever the drafter.

    python bench/verify_cost.py                        # writes bench/results/verify_cost.{json,md}
    python bench/verify_cost.py --baseline 414072d --contexts 64,600,1500   # beside that revision's kernels

Each t(n) is one forward of the engine's native runner plus the LM head over a batch of n rows, one sequence's n
tokens written to its paged cache after `context` tokens (what the engine times at start-up, Engine.measure_cost).
With --baseline, the revision's kernels are built as a second extension and the two take turns for every size in
every round, so drift on the shared machine falls on both.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from common import command_line, fmt, machine, markdown_table, native_kernels_at, stats, write_json


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("-m", "--model", default="smollm2-135m")
    p.add_argument("--quant", default="int4")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--sizes", default="1,2,3,4,6,9,12,16")
    p.add_argument("--contexts", default="64,600")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--baseline", default="", help="a git revision whose kernels to time beside the current ones")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "verify_cost"))
    a = p.parse_args()

    import fastdecode.quant.linear as quant_linear
    from fastdecode import LLM
    from fastdecode.engine.kv_cache import BlockTable
    from fastdecode.runners import Batch
    from fastdecode.speculative.policy import probe_tokens

    llm = LLM(a.model, quant=a.quant or "none", threads=a.threads)
    runner, kv, model = llm.runner, llm.engine.kv, llm.model
    if runner.name != "native":
        raise SystemExit("error: the native kernels are not available on this machine")
    kernels = {"current": runner.ops}
    if a.baseline:
        print(f"building the kernels of {a.baseline} ...", flush=True)
        kernels[a.baseline] = native_kernels_at(a.baseline)
    shapes = {k: {} for k in kernels}  # each build's own ModelShape objects, by layer range
    shapes["current"] = runner.shapes
    current_ops = quant_linear.native_ops

    def use(k):  # the layer stack and the LM head (a QuantLinear outside the C++ step) both switch
        runner.ops, runner.shapes = kernels[k], shapes[k]
        quant_linear.native_ops = lambda: kernels[k]

    sizes = [int(n) for n in a.sizes.split(",")]
    contexts = [int(c) for c in a.contexts.split(",")]
    room = min(llm.max_seq_len, kv.capacity)
    if max(contexts) + max(sizes) > room:
        raise SystemExit(f"error: a context of {max(contexts)} and {max(sizes)} new tokens exceed the cache's {room}")
    table = BlockTable()
    kv.reserve(table, max(contexts) + max(sizes))

    @torch.inference_mode()
    def forward(n: int, start: int):
        """n rows of one sequence after `start` cached tokens, and the LM head on all of them (a verify step)."""
        batch = Batch(torch.tensor(probe_tokens(n, model.config.vocab_size)), torch.arange(start, start + n),
                      torch.tensor(kv.slots(table, start, start + n)), torch.tensor([0, n]), torch.tensor([start]),
                      torch.tensor([table.blocks]), kv.block_size, logit_rows=torch.arange(n))
        model.head(runner.forward(batch)[batch.logit_rows])

    rows = []
    try:
        forward(max(contexts), 0)  # the context the steps attend to
        for context in contexts:
            times = {(k, n): [] for k in kernels for n in sizes}
            for r in range(a.rounds + 1):  # round 0 warms up
                for k in kernels:
                    use(k)
                    for n in sizes:
                        t0 = time.perf_counter()
                        forward(n, context)
                        if r:
                            times[(k, n)].append(time.perf_counter() - t0)
            for k in kernels:
                t1 = statistics.median(times[(k, 1)])
                for n in sizes:
                    s = stats([t * 1e3 for t in times[(k, n)]])
                    row = {"kernels": k, "context": context, "n": n, "ms": s, "ratio_to_t1": s["median"] / 1e3 / t1,
                           "bound": n * t1 / (s["median"] / 1e3)}
                    if a.baseline and k == "current":
                        row["speedup_vs_baseline"] = statistics.median(times[(a.baseline, n)]) / (s["median"] / 1e3)
                    rows.append(row)
                    print(f"context {context:4d} {k:>10} t({n:2d}) {s['median']:7.2f} ms (min {s['min']:.2f}, max "
                          f"{s['max']:.2f})  t(n)/t(1) {row['ratio_to_t1']:.2f}" +
                          (f"  {row['speedup_vs_baseline']:.2f}x baseline" if "speedup_vs_baseline" in row else ""),
                          flush=True)
    finally:
        use("current")
        quant_linear.native_ops = current_ops
        kv.release(table)
        llm.close()

    report = {"model": a.model, "quant": a.quant, "threads": a.threads, "rounds": a.rounds, "baseline": a.baseline,
              "machine": machine(), "command": command_line(), "rows": rows}
    out = Path(a.out)
    write_json(out.with_suffix(".json"), report)
    headers = ["context", "kernels", "n", "t(n) ms, median (min-max)", "t(n) / t(1)", "bound n t(1) / t(n)"]
    if a.baseline:
        headers.append(f"x {a.baseline}")
    table = [[str(r["context"]), r["kernels"], str(r["n"]),
              f"{r['ms']['median']:.2f} ({r['ms']['min']:.2f}-{r['ms']['max']:.2f})", f"{r['ratio_to_t1']:.2f}",
              f"{r['bound']:.2f}"] + ([fmt(r.get("speedup_vs_baseline"), ".2f")] if a.baseline else [])
             for r in rows]
    m = report["machine"]
    out.with_suffix(".md").write_text(
        f"# Verify-step cost: {a.model} ({a.quant or 'float32'}), {a.threads} threads\n\n`{report['command']}` on "
        f"{m['cpu']} ({m['cores']} cores), {m['date']}, load average at start {m['load_avg_1m_at_start']}.\n\n"
        f"{a.rounds} rounds, every kernel build and size in every round. `bound`: n t(1) / t(n), the speedup if all "
        f"n - 1 drafts of every step were accepted.\n\n" + markdown_table(headers, table) + "\n")
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
