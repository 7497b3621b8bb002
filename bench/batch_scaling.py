"""What continuous batching buys in decode alone: engine steps with B = 1, 2, 4, 8 sequences decoding side by side.

The concurrency sweep of `fastdecode bench` measures users end to end, prefills included; this isolates the engine's
decode step. B requests with the same long prompt (their last tokens differ, so no two are the same sequence) are
prefilled, then timed over decode-only steps: total tok/s and per-sequence tok/s by B, the step's time split into
the forward pass, the LM head and the rest (scheduling, batching, sampling, Python).

    python bench/batch_scaling.py                 # SmolLM2-135M as shipped (Q4_1 GGUF), 2 threads
    python bench/batch_scaling.py --kv-dtype float32 --batches 1,4
    python bench/batch_scaling.py --spread 200,2400 --baseline fb97938
                                                  # prompts of 200 .. 2400 tokens (as a server's users have), and the
                                                  # native step of a git revision in alternate repeats beside ours

Writes bench/results/batch_scaling.{json,md}.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import command_line, machine, markdown_table, native_kernels_at, short_sha, write_json  # noqa: E402
from decode import prompt_ids  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batches", default="1,2,4,8")
    p.add_argument("--steps", type=int, default=32, help="timed decode steps per repeat")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kv-dtype", default="float16")
    p.add_argument("--context", type=int, default=0,
                   help="each prompt cut or extended to this many tokens (0: the 585-token prompt of bench/decode.py)")
    p.add_argument("--spread", default="", help="MIN,MAX: sequence i of B gets a prompt of MIN + (MAX - MIN) i / (B - 1) "
                   "tokens (the long prompt repeated), instead of all the same")
    p.add_argument("--baseline", default="", help="also time the native step of this git revision, in alternate "
                   "repeats on the same sequences")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    a = p.parse_args()

    from fastdecode import LLM, SamplingParams

    _, ids, _ = prompt_ids(a.model, a.context)
    ids = ids[: a.context or None]
    spread = [int(n) for n in a.spread.split(",")] if a.spread else None
    llm = LLM(a.model, threads=a.threads, kv_dtype=a.kv_dtype, prefix_cache=False)
    engine = llm.engine
    engine.background = False  # this script drives the steps itself, in the thread that owns the OpenMP team
    builds = {"current": getattr(engine.runner, "ops", None)}
    if a.baseline:
        if builds["current"] is None:
            raise SystemExit("--baseline compares native steps; this engine runs PyTorch's")
        builds[a.baseline] = native_kernels_at(a.baseline)

    def prompt(i, B):  # distinct last tokens: no two sequences are the same
        if not spread:
            return ids[:-1] + [ids[-1] + i]
        n = spread[0] + (spread[1] - spread[0]) * i // max(B - 1, 1)
        return (ids * (n // len(ids) + 1))[:n - 1] + [ids[-1] + i]
    parts = {"forward": 0.0, "head": 0.0}
    forward, head = engine.runner.forward, engine.model.head

    def timed(name, f):
        def g(*args):
            t = time.perf_counter()
            out = f(*args)
            parts[name] += time.perf_counter() - t
            return out
        return g

    engine.runner.forward, engine.model.head = timed("forward", forward), timed("head", head)
    rows = []
    for B in [int(b) for b in a.batches.split(",")]:
        params = SamplingParams(max_tokens=len(builds) * a.repeats * (a.steps + 4) + 8, temperature=0, ignore_eos=True)
        seqs = [engine.add_request(prompt(i, B), params) for i in range(B)]
        while any(s.num_output == 0 for s in seqs):
            engine.pump()
        runs = {name: [] for name in builds}
        for r in range(a.repeats):
            for name in list(builds)[::1 if r % 2 == 0 else -1]:  # builds take turns, each first in half the repeats
                if builds[name] is not None:
                    engine.runner.ops = builds[name]
                for _ in range(4):  # settle: the prefill chunks are behind, every step is decode only
                    engine.pump()
                parts.update(forward=0.0, head=0.0)
                t = time.perf_counter()
                for _ in range(a.steps):
                    engine.pump()
                step = (time.perf_counter() - t) / a.steps
                runs[name].append({"step_ms": 1e3 * step, "forward_ms": 1e3 * parts["forward"] / a.steps,
                                   "head_ms": 1e3 * parts["head"] / a.steps})
        for s in seqs:
            engine.abort(s)
        engine.pump()
        for name, build_runs in runs.items():
            median = {k: statistics.median(r[k] for r in build_runs) for k in build_runs[0]}
            rows.append({"build": name, "batch": B, "prompt_tokens": [len(s.prompt_ids) for s in seqs], **median,
                         "total_tok_s": B * 1e3 / median["step_ms"], "per_sequence_tok_s": 1e3 / median["step_ms"],
                         "runs": build_runs})
    for r in rows:
        one = next(o for o in rows if o["build"] == r["build"])["total_tok_s"]
        r["total_vs_first"], r["per_sequence_vs_first"] = r["total_tok_s"] / one, r["per_sequence_tok_s"] / one
    report = {"benchmark": "batch_scaling", "commit": short_sha("HEAD"), "command": command_line(),
              "machine": machine(), "model": a.model, "threads": a.threads, "kv_dtype": a.kv_dtype,
              "decode_path": llm.decode_path, "prompt_tokens": spread or len(ids), "steps": a.steps,
              "repeats": a.repeats, "baseline": a.baseline or None, "rows": rows}
    write_json(a.out / "batch_scaling.json", report)
    headers = ["build", "sequences", "step ms", "forward ms", "head ms", "other ms", "total tok/s", "per sequence tok/s",
               f"total x B={rows[0]['batch']}", f"per sequence x B={rows[0]['batch']}"]
    cells = [[r["build"], str(r["batch"]), f"{r['step_ms']:.1f}", f"{r['forward_ms']:.1f}", f"{r['head_ms']:.1f}",
              f"{r['step_ms'] - r['forward_ms'] - r['head_ms']:.2f}", f"{r['total_tok_s']:.0f}",
              f"{r['per_sequence_tok_s']:.1f}", f"{r['total_vs_first']:.2f}", f"{r['per_sequence_vs_first']:.2f}"]
             for r in rows]
    m = report["machine"]
    md = (f"# Decode steps by batch size ({a.model}, {llm.decode_path}, KV {a.kv_dtype}, {a.threads} threads)\n\n"
          + markdown_table(headers, cells)
          + f"\n\n- `{report['command']}` at {report['commit']}; {m['cpu']}, load average {m['load_avg_1m_at_start']:.1f}"
            f" at start.\n- Each sequence: a {f'{spread[0]}- to {spread[1]}' if spread else len(ids)}-token prompt, "
            f"then decode only; median of {a.repeats} repeats of {a.steps} steps"
            + (" (the builds in turn; current: the working tree)" if a.baseline else "") + ".\n")
    (a.out / "batch_scaling.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
