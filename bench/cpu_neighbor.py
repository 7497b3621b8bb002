"""What a busy neighbour on the same cores costs the decode step: the engine decoding a batch in-process, in rounds
alone and beside a process that keeps one core busy a given share of the time (the server's event loop, an agent's
CLI and its tools share the user's cores with the engine).

Each side (a git revision, or `.` for the working tree) runs in its own process, the sides taking turns; within a
process the rounds alternate alone / beside the neighbour.

    python bench/cpu_neighbor.py --sides df1e6e0,.        # a revision against the working tree
    python bench/cpu_neighbor.py --busy-us 100 --period-us 1500 --processes 2 --rounds 6

Writes bench/results/cpu_neighbor.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (command_line, fmt_range, git_state, machine, markdown_table, package_at, short_sha,  # noqa: E402
                    stats, write_json)

NEIGHBOUR = """
import time, sys
busy, pause = float(sys.argv[1]) / 1e6, float(sys.argv[2]) / 1e6
while True:
    t = time.perf_counter()
    while time.perf_counter() - t < busy:
        pass
    time.sleep(pause)
"""


def child(a) -> list[tuple[bool, float]]:
    """-> (beside the neighbour, output tok/s) per round."""
    import numpy as np

    from fastdecode import LLM, SamplingParams

    llm = LLM(a.model, threads=a.threads, speculate="none")
    engine = llm.engine
    engine.background = False  # this thread steps it
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(100, 40000, a.prompt_tokens)] for _ in range(a.batch)]

    def decode(n: int) -> float:
        params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        for ids in prompts:  # the prompts first, so the timed part is the decode steps of a full batch
            engine.add_request(ids, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
        while engine.pump():
            pass
        seqs = [engine.add_request(ids, params) for ids in prompts]  # prefix-cache hits: one row each to compute
        start = time.perf_counter()
        while not all(s.finished for s in seqs):
            engine.pump()
        return sum(s.num_output for s in seqs) / (time.perf_counter() - start)

    decode(4)
    out = []
    try:
        for r in range(a.rounds):
            beside = r % 2 == 1
            neighbour = subprocess.Popen([sys.executable, "-c", NEIGHBOUR, str(a.busy_us), str(a.period_us)]) \
                if beside else None
            try:
                out.append((beside, decode(a.tokens)))
            finally:
                if neighbour is not None:
                    neighbour.kill()
                    neighbour.wait()
    finally:
        llm.close()
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sides", default=".", help="comma-separated git revisions, `.` for the working tree")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=400)
    p.add_argument("--tokens", type=int, default=200, help="decoded per sequence each round")
    p.add_argument("--busy-us", type=float, default=100.0, help="the neighbour's busy spell")
    p.add_argument("--period-us", type=float, default=1500.0, help="its sleep between spells")
    p.add_argument("--rounds", type=int, default=6, help="per process, alternately alone and beside it")
    p.add_argument("--processes", type=int, default=2, help="per side, the sides taking turns")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    a = p.parse_args()
    if a.child:
        print(json.dumps(child(a)))
        return
    sides = a.sides.split(",")
    paths = {s: str(Path(__file__).resolve().parents[1]) if s == "." else str(package_at(s)) for s in sides}
    names = {s: "working tree" if s == "." else short_sha(s) for s in sides}
    forward = [f"--{k.replace('_', '-')}={v}" for k, v in vars(a).items() if k not in ("sides", "child", "out")]
    rounds = {s: [] for s in sides}
    for i in range(a.processes):
        for s in sides if i % 2 == 0 else sides[::-1]:
            argv = [__file__, *forward, "--child"]
            code = (f"import sys, runpy; sys.path.insert(0, {paths[s]!r}); sys.argv = {argv!r}; "
                    f"runpy.run_path({__file__!r}, run_name='__main__')")
            out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                                 env={**os.environ, "FASTDECODE_KV_DISK_GB": "0"}).stdout  # (serving_overhead.py)
            rounds[s] += json.loads(out.splitlines()[-1])
            print(f"process {i + 1}/{a.processes}, {names[s]}: {rounds[s][-a.rounds:]}", file=sys.stderr)
    rows = []
    for s in sides:
        alone = [t for beside, t in rounds[s] if not beside]
        beside = [t for b, t in rounds[s] if b]
        rows.append({"side": names[s], "alone_tok_s": stats(alone), "beside_tok_s": stats(beside),
                     "beside_of_alone": stats([b / x for b, x in zip(beside, alone)])})
    share = a.busy_us / (a.busy_us + a.period_us)
    report = {"benchmark": "cpu_neighbor", **git_state(), "command": command_line(), "machine": machine(),
              "model": a.model, "threads": a.threads, "batch": a.batch, "neighbour_busy_share": share, "rows": rows}
    write_json(a.out / "cpu_neighbor.json", report)
    cells = [[r["side"], fmt_range(r["alone_tok_s"]), fmt_range(r["beside_tok_s"]),
              fmt_range(r["beside_of_alone"], ".2f")] for r in rows]
    md = (f"# A busy neighbour on the cores ({a.model}, batch {a.batch}, {a.threads} threads)\n\n"
          + markdown_table(["side", "alone tok/s", "beside the neighbour tok/s", "beside / alone (same process)"],
                           cells)
          + f"\n\n- The neighbour: busy {a.busy_us:.0f} us, then asleep {a.period_us:.0f} us (about {share:.0%} of "
            f"one core, plus its wake-ups).\n- `{report['command']}` at {report['commit'][:10]}"
            f"{' (dirty)' if report['dirty'] else ''}; {report['machine']['cpu']}.\n"
            f"- Median (min-max) over {a.processes} processes x {a.rounds // 2} rounds each way; decode of a full "
            f"batch only (its prompts cached first).\n")
    (a.out / "cpu_neighbor.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
