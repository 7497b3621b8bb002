"""Drafters that run a model, inside the engine's batch: N requests at once (each its own coding-agent prompt) with
plain decoding and with `layerskip` / `draft:MODEL`, their tokens per second in all, and whether every request's
greedy tokens equal plain decoding's.

    python bench/model_drafters.py                     # 4 users, 3 rounds; bench/results/model-drafters.{json,md}
    python bench/model_drafters.py --configs none,layerskip,layerskip! --users 4 --rounds 3
    python bench/model_drafters.py --configs none,layerskip@55f3ac3  # beside fastdecode at another revision

A config ending in `!` verifies every draft in full (the adaptive policy off): what drafting costs and yields when it
always runs, against the adaptive default that drafts only while it pays. `draft:smollm2-135m` on SmolLM2-135M is
the target drafting for itself: every draft is accepted, so it shows the mechanism's ceiling of acceptance and its
cost, not a useful pairing (no smaller model with SmolLM2's vocabulary is registered). Each config runs in a worker
process of its own; rounds run every config in turn (A B C A B C), so drift on a shared machine falls on all of them.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time
from pathlib import Path

from common import command_line, fmt, fmt_range, machine, markdown_table, package_at, stats, write_json

MODEL = "smollm2-135m"


def worker(config: str, model: str, quant: str, threads: int, conn):
    """One config's LLM: answers each batch of prompts sent with (tokens per request, seconds, drafted, accepted)."""
    name, _, rev = config.partition("@")
    if rev:
        sys.path.insert(0, str(package_at(rev)))
    from fastdecode import LLM, SamplingParams

    forced = name.endswith("!")
    llm = LLM(model, quant=quant or None, threads=threads, speculate=name.rstrip("!"))
    engine = getattr(llm, "engine", None)
    if forced:
        speculator = engine.speculator if engine is not None and engine.speculator is not None else llm.speculator
        speculator.policy.adaptive = False
    conn.send("ready")
    while (job := conn.recv()) is not None:
        prompts, max_tokens = job
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        t0 = time.perf_counter()
        out = llm.generate(prompts, params) if len(prompts) > 1 else [llm.generate(prompts[0], params)]
        seconds = time.perf_counter() - t0
        spec = [c.speculation or {} for c in out]
        conn.send(([c.token_ids for c in out], seconds, sum(s.get("drafted", 0) for s in spec),
                   sum(s.get("accepted", 0) for s in spec)))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=MODEL)
    p.add_argument("--quant", default="int4")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--configs", default="none,layerskip,layerskip!,draft:smollm2-135m!")
    p.add_argument("--users", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    p.add_argument("--name", default="model-drafters")
    args = p.parse_args(argv)

    from fastdecode.workloads import CATEGORIES, load_workload

    items = [item for c in CATEGORIES for item in load_workload(c)[:1]][:args.users]
    prompts = [item.messages[-1]["content"] for item in items]
    configs = list(dict.fromkeys(args.configs.split(",")))
    ctx = mp.get_context("spawn")
    conns = {}
    for config in configs:
        parent, child = ctx.Pipe()
        ctx.Process(target=worker, args=(config, args.model, args.quant, args.threads, child), daemon=True).start()
        assert parent.recv() == "ready"
        conns[config] = parent
    runs = {c: {"tok_s": [], "drafted": 0, "accepted": 0, "tokens": None} for c in configs}
    for _ in range(args.rounds):
        for config in configs:
            conns[config].send((prompts, args.max_tokens))
            tokens, seconds, drafted, accepted = conns[config].recv()
            r = runs[config]
            r["tok_s"].append(sum(len(t) for t in tokens) / seconds)
            r["drafted"] += drafted
            r["accepted"] += accepted
            r["tokens"] = tokens
    for conn in conns.values():
        conn.send(None)
    plain = runs[configs[0]]["tokens"]
    rows, results = [], {}
    for config in configs:
        r = runs[config]
        s = stats(r["tok_s"])
        equal = sum(a == b for a, b in zip(r["tokens"], plain))
        results[config] = {"tok_s": s, "drafted": r["drafted"], "accepted": r["accepted"],
                           "equal_to_first": f"{equal}/{len(plain)}"}
        rows.append([config, fmt_range(s), fmt(s["median"] / stats(runs[configs[0]]["tok_s"])["median"], ".2f"),
                     str(r["drafted"]), str(r["accepted"]), f"{equal}/{len(plain)}"])
    md = (f"# Model drafters in a batch of {args.users} ({args.model}, {args.quant or 'float32'}, {args.threads} "
          f"threads, {args.max_tokens} tokens each, {args.rounds} rounds)\n\n`{command_line()}`\n\n"
          + markdown_table(["config", "tok/s in all, median (min-max)", f"x {configs[0]}", "drafted", "accepted",
                            f"greedy = {configs[0]}"], rows) + "\n")
    write_json(args.out / f"{args.name}.json", {"command": command_line(), "machine": machine(),
                                                "args": vars(args) | {"out": str(args.out)}, "results": results})
    (args.out / f"{args.name}.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
