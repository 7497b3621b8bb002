"""A resent conversation's short tail: time to first token when all but the last few tokens of a long prompt are in
the prefix cache, with prompt rows' attention in bf16 products (the default where the CPU has AVX512-BF16) and in
float32 (FASTDECODE_BF16_ATTENTION=0), each in a fresh process, alternating.

Each process prefills the prompt once cold, then sends it again --repeats times and takes the median. The cache holds
whole blocks of 32 tokens, so a prompt of N tokens leaves a tail of N mod 32 rows (32 when N is a multiple of 32):
the default lengths leave 32 rows and one row.

    .venv/bin/python bench/prefix_tail.py                      # the 1.5B shape, 8,192 and 8,193 tokens
    .venv/bin/python bench/prefix_tail.py --lengths 4096,4097 --repeats 3

Writes prefix_tail.json (with the commit) and prefix_tail.md into --out.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from common import command_line, fmt, fmt_range, machine, markdown_table, stats, write_json
from prefill import prompt
from shapes import shape_file

KERNELS = {"bf16": "1", "float32": "0"}  # FASTDECODE_BF16_ATTENTION


def child(path: str, length: int, repeats: int, threads: int) -> dict:
    from fastdecode import LLM, SamplingParams

    llm = LLM(path, threads=threads, max_seq_len=length + 8, speculate="none", kv_disk_gb=0)
    one = SamplingParams(max_tokens=1, temperature=0.0)
    ids = prompt(length, 7)
    llm.generate(ids, one)  # cold: fills the prefix cache
    ttft, cached = [], 0
    for _ in range(repeats):
        start = time.perf_counter()
        cached = llm.generate(ids, one).timings.cached_tokens
        ttft.append(time.perf_counter() - start)
    llm.close()
    return {"ttft_s": ttft, "cached_tokens": cached}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen2.5-coder-1.5b")
    p.add_argument("--type", default="Q4_0")
    p.add_argument("--lengths", default="8192,8193")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "prefix_tail")
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(child(a.child, int(a.lengths), a.repeats, a.threads)))
        return
    path = shape_file(a.shape, a.type, print)
    results = {}
    for length in [int(n) for n in a.lengths.split(",")]:
        for kernel, switch in KERNELS.items():
            argv = [sys.executable, __file__, "--child", str(path), "--lengths", str(length),
                    "--repeats", str(a.repeats), "--threads", str(a.threads)]
            done = subprocess.run(argv, capture_output=True, text=True, check=True,
                                  env=dict(os.environ, FASTDECODE_BF16_ATTENTION=switch))
            run = json.loads(done.stdout.splitlines()[-1])
            results.setdefault(str(length), {})[kernel] = {**run, "ttft_ms": stats([t * 1e3 for t in run["ttft_s"]])}
            print(length, kernel, fmt(results[str(length)][kernel]["ttft_ms"]["median"]), "ms", flush=True)
    rows = [[length, str(int(length) - r["bf16"]["cached_tokens"]), *(fmt_range(r[k]["ttft_ms"]) for k in KERNELS)]
            for length, r in results.items()]
    table = markdown_table(["prompt tokens", "tail rows", "TTFT ms, bf16: median (min-max)",
                            "TTFT ms, float32: median (min-max)"], rows)
    doc = {"command": command_line(), "machine": machine(), "file": str(path), "repeats": a.repeats,
           "results": results}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    write_json(a.out.with_suffix(".json"), doc)
    a.out.with_suffix(".md").write_text(
        f"# A resent prompt's short tail\n\n`{command_line()}`\n\n{machine()['cpu']}, {a.threads} threads, "
        f"{path.name}; median of {a.repeats} resends after one cold prefill, each kernel in a fresh process.\n\n"
        f"{table}\n")
    print(table)


if __name__ == "__main__":
    main()
