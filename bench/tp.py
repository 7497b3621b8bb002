"""Tensor-parallel scaling on this machine: decode tok/s of 1 rank x 1 thread, 1 rank x 2 threads and 2 ranks x
1 thread (torchrun; the ranks' collectives over shared memory, and over gloo's loopback TCP for comparison), beside
the roofline's tensor-parallel prediction for each.

    python bench/tp.py            # 3 rounds x 3 timed runs of 64 tokens; writes bench/results/tp.{json,md}
    python bench/tp.py --quick    # smoke run: 1 round x 1 run of 16 tokens; writes bench/results/tp-quick.{json,md}
    python bench/tp.py --quant int8 --rows 1x2-native,2x1-native --name tp-int8   # the int8 native step only

Each row then answers --users (4) requests at once, each its own prompt: the tok/s they make together.

Every row decodes the same greedy tokens, with PyTorch's modules or with the native C++ step (which under TP calls
the all-reduce after each layer's attention and MLP). Each row is its own process
(or pair of processes under torchrun); rows are timed round-robin, A B C A B C, so drift on a shared machine falls
on all of them alike.

The prediction is fastdecode.roofline.calc's: a step reads bytes / tp per rank at the bandwidth one rank gets (the
probe at that rank's thread count), then waits for 2 all-reduces per layer plus the logit gather, each costing the
all-reduce latency measured here between the two ranks (over the transport the row uses). On one CPU both ranks
share a memory bus; over gloo the "interconnect" is loopback TCP and communication dominates.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common import command_line, fmt, fmt_range, machine, markdown_table, stats, write_json

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "def quicksort(arr):\n    \"\"\"Sort a list of integers.\"\"\"\n"
WEIGHTS = {"none": "float32 weights", "gguf": "the file's own formats"}  # what --quant gives every row
# key: (label, ranks, threads per rank, native C++ step, environment)
ROWS = {"1x1": ("1 rank x 1 thread", 1, 1, False, {}), "1x2": ("1 rank x 2 threads", 1, 2, False, {}),
        "2x1": ("2 ranks x 1 thread", 2, 1, False, {}),
        "1x2-native": ("1 rank x 2 threads, native step", 1, 2, True, {}),
        "2x1-native": ("2 ranks x 1 thread, native step", 2, 1, True, {}),
        "2x1-native-gloo": ("2 ranks x 1 thread, native step, gloo", 2, 1, True, {"FASTDECODE_TP_SHM": "0"})}


# ---- worker: one row, one process per rank ------------------------------------------------------------------------
def allreduce_us(comm, hidden_size: int, n: int = 300) -> float:
    """Median time of one all-reduce of a decode step's activations (1 x hidden, float32) between the ranks."""
    import torch

    x = torch.ones(1, 1, hidden_size)
    for _ in range(20):
        comm.all_reduce(x)
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        comm.all_reduce(x)
        times.append(time.perf_counter() - t0)
    return sorted(times)[n // 2] * 1e6


def worker(args):
    import torch

    from fastdecode.engine.llm import LLM
    from fastdecode.engine.sampling import SamplingParams

    torch.set_num_threads(args.threads)
    world = int(os.environ.get("WORLD_SIZE", 1))
    out = {"ranks": world, "threads": args.threads}
    if world > 1:
        from fastdecode.parallel.group import init_group
        from fastdecode.parallel.llm import ParallelLLM
        from fastdecode.parallel.load import checkpoint_config
        from fastdecode.loading.catalog import resolve

        comm = init_group(world).comm
        out["transport"] = comm.name
        out["allreduce_us"] = allreduce_us(comm, checkpoint_config(resolve(args.model))[0].hidden_size)
        llm = ParallelLLM(args.model, tp=world, quant=args.quant, threads=args.threads, max_seq_len=512,
                          native=args.native)
        if not llm.leads:
            llm.follow()
            return
    else:
        llm = LLM(args.model, quant=args.quant, threads=args.threads, max_seq_len=512, native=args.native)
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    llm.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))  # warm-up
    runs = [llm.generate(PROMPT, params) for _ in range(args.repeats)]
    if args.users > 1:  # users at once, each its own prompt: what every output token cost the batch
        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.users) as pool:
            done = list(pool.map(lambda i: llm.generate(f"# user {i}\n{PROMPT}", params), range(args.users)))
        out["users_tok_s"] = sum(c.timings.output_tokens for c in done) / (time.perf_counter() - t0)
    out.update(tok_s=[c.timings.output_tok_s for c in runs], token_ids=runs[0].token_ids,
               prompt_tokens=runs[0].timings.prompt_tokens, weight_bytes=llm.weight_bytes_per_token(),
               kv_bytes=llm.kv_bytes_per_token(runs[0].timings.prompt_tokens + args.tokens // 2))
    if world > 1:
        llm.close()
    Path(args.out).write_text(json.dumps(out))


def run_row(args, ranks: int, threads: int, native: bool, env: dict, out: Path) -> dict:
    env = {**os.environ, **env, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT)}
    cmd = [__file__, "--worker", "--model", args.model, "--quant", args.quant, "--threads", str(threads),
           "--tokens", str(args.tokens),
           "--repeats", str(args.repeats), "--users", str(args.users), "--out", str(out)] + (["--native"] if native else [])
    if ranks > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
               *cmd]
    else:
        cmd = [sys.executable, *cmd]
    subprocess.run(cmd, check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


# ---- prediction ---------------------------------------------------------------------------------------------------
def predict(model: str, bytes_per_token: float, context: int, ranks: int, threads: int, allreduce: float | None):
    """The roofline's decode ceiling for one row, from the probe's bandwidth at `threads` threads."""
    from fastdecode.loading.catalog import resolve
    from fastdecode.roofline.calc import Scenario, roofline
    from fastdecode.roofline.hardware import this_machine
    from fastdecode.roofline.models import get_model
    from fastdecode.roofline.probe import cached_probe

    probe = cached_probe(int(bytes_per_token / ranks), threads)
    hw = this_machine(probe["working_set_gb_s"], probe["matmul_tflops"], threads)
    r = roofline(Scenario(model=get_model(str(resolve(model))), hardware=hw, context=context, tp=ranks, pp=1,
                          bytes_per_token=bytes_per_token, allreduce_us=allreduce if ranks > 1 else None))
    return {"tok_s": r.decode_tok_s_ceiling, "bandwidth_gb_s": probe["working_set_gb_s"],
            "memory_s": r.step["memory_s"], "comm_s": r.step["comm_s"]}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="a registered name or a GGUF/safetensors path")
    p.add_argument("--quant", default="none", help="none (float32 shards), int8 or int4: every row alike")
    p.add_argument("--rows", default=",".join(ROWS), help=f"of {', '.join(ROWS)}; the first must be one rank")
    p.add_argument("--name", default=None, help="results file stem (default tp, or tp-quick)")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="timed runs per row per round")
    p.add_argument("--rounds", type=int, default=3, help="round-robin passes over the rows (a process each)")
    p.add_argument("--quick", action="store_true", help="smoke run: 1 round x 1 run of 16 tokens, as tp-quick.*")
    p.add_argument("--users", type=int, default=4, help="then this many requests at once, once per round")
    p.add_argument("--out-dir", type=Path, default=ROOT / "bench" / "results")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--native", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.quick:
        args.tokens, args.repeats, args.rounds = 16, 1, 1
    rows = [ROWS[key] for key in args.rows.split(",")]
    if rows[0][1] != 1:
        p.error("the first of --rows is the base: one rank")
    started = machine()
    results = {label: {"ranks": ranks, "threads": threads, "native": native, "env": env, "tok_s": []}
               for label, ranks, threads, native, env in rows}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for label, ranks, threads, native, env in rows:
                print(f"round {round_ + 1}/{args.rounds}: {label}", file=sys.stderr, flush=True)
                got = run_row(args, ranks, threads, native, env, Path(tmp) / "row.json")
                row = results[label]
                row["tok_s"] += got["tok_s"]
                row.setdefault("users_tok_s", []).extend([got["users_tok_s"]] if "users_tok_s" in got else [])
                row.update({k: got[k] for k in ("token_ids", "prompt_tokens", "weight_bytes", "kv_bytes")})
                if "allreduce_us" in got:
                    row.setdefault("allreduce_us_runs", []).append(got["allreduce_us"])
                    row["transport"] = got["transport"]
    whole = results[rows[0][0]]  # the one-rank model: what every rank together reads per token
    reference_ids = whole["token_ids"]
    bytes_per_token = whole["weight_bytes"] + whole["kv_bytes"]
    context = whole["prompt_tokens"] + args.tokens // 2
    for label, ranks, threads, native, _ in rows:
        row = results[label]
        row["stats"] = stats(row["tok_s"])
        row["users_stats"] = stats(row["users_tok_s"]) if row["users_tok_s"] else None
        allreduce = stats(row["allreduce_us_runs"])["median"] if "allreduce_us_runs" in row else None
        row["allreduce_us"] = allreduce
        row["roofline"] = predict(args.model, bytes_per_token, context, ranks, threads, allreduce)
        row["same_tokens_as_1x1"] = row.pop("token_ids") == reference_ids
    data = {"command": command_line(), "machine": started, "model": args.model, "quant": args.quant,
            "tokens": args.tokens,
            "repeats": args.repeats, "rounds": args.rounds, "bytes_per_token": bytes_per_token, "context": context,
            "rows": results}
    stem = args.name or ("tp-quick" if args.quick else "tp")
    write_json(args.out_dir / f"{stem}.json", data)
    base = results[rows[0][0]]["stats"]["median"]
    table_rows = []
    for label, *_ in rows:
        row = results[label]
        r = row["roofline"]
        table_rows.append([label, fmt_range(row["stats"]), fmt(row["stats"]["median"] / base, ".2f") + "x",
                           fmt(r["tok_s"], ".0f"), fmt(row["stats"]["median"] / r["tok_s"], ".2f") + "x",
                           fmt(r["memory_s"] * 1e3, ".1f"), fmt(r["comm_s"] * 1e3, ".2f"),
                           fmt(row["allreduce_us"], ".1f"), row.get("transport", "-"),
                           "yes" if row["same_tokens_as_1x1"] else "NO",
                           fmt_range(row["users_stats"]) if row["users_stats"] else "-"])
    md = "\n".join([
        f"# Tensor parallelism on this machine: {args.model}", "",
        f"`{command_line()}`  ",
        f"{started['cpu']}, {started['cores']} cores, torch {started['torch']}, {started['date']}, load average "
        f"{fmt(started['load_avg_1m_at_start'], '.2f')} at start. Greedy decode of {args.tokens} tokens, "
        f"{WEIGHTS.get(args.quant, args.quant + ' weights')}, "
        f"{args.rounds} rounds x {args.repeats} runs per row; output tok/s as median (min-max).", "",
        markdown_table(["row", "output tok/s", f"vs {rows[0][0]}", "roofline tok/s", "of roofline",
                        "roofline memory ms", "roofline comm ms", "all-reduce us", "transport", "same tokens",
                        f"{args.users} users, tok/s in all"], table_rows), "",
        "Roofline: bytes read per token / ranks at the probe's bandwidth for that thread count, plus "
        "(2 x layers + 1) all-reduces at the latency measured between the two ranks over the row's transport. "
        "Each TP decode step also broadcasts its command (2 small broadcasts) and all-reduces the embedding.", ""])
    (args.out_dir / f"{stem}.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
