"""How fast the native kernels stream a real model's matrices at decode (one activation row): GB/s of weights per
format and shape, beside x.sum() over as many bytes (the machine's read bandwidth), optionally beside the kernels of
another git revision, taking turns in every round.

    python bench/stream.py                                  # Llama-3.1-8B's, Qwen3-30B-A3B's and gpt-oss-20b's experts
    python bench/stream.py --baseline c22ff8b --threads 1   # A/B against a revision, on one core

The weights are random tiles in the packed layouts the GGUF loader makes (speed depends on bytes, not values), with
valid scales, in huge pages as a loaded model's are (fastdecode.memory), and enough copies of each matrix
(called in turn) that none is served from cache. Writes stream.json (with the commit) and stream.md.
"""
import argparse
import statistics
import time
from pathlib import Path

import torch

from common import command_line, git_state, machine, markdown_table, native_kernels_at, short_sha, write_json
from fastdecode import memory
from fastdecode.kernels import native_ops

# format: (op name, bytes per tile of 4 rows and K step, K step, where the fp16 scales lie in a tile; MXFP4: its
# E8M0 scale bytes)
FORMATS = {"Q4_0": ("q4_linear", 160, 64, 32), "Q8_0": ("q8_linear", 272, 64, 16),
           "Q4_K": ("kq_linear", 592, 256, 16), "Q6_K": ("kq_linear", 840, 256, 8), "MXFP4": ("fp4_linear", 136, 64, 8)}
# (N, K) of the matrices a token reads: Llama-3.1-8B's q/k/v, o, gate/up, down; the MoE models' experts
MATRICES = {"llama-3.1-8b": [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)],
            "qwen3-30b-a3b expert": [(1536, 2048), (2048, 768)],
            "gpt-oss-20b expert": [(5760, 2880), (2880, 2880)]}
WORKING_SET = 400e6  # bytes of copies per matrix: well past the last-level cache


def tiles(fmt: str, n: int, k: int, copies: int) -> torch.Tensor:
    """(copies, N/4, K/step, bytes) random tiles in one huge-page buffer, every scale 2^-8 (no denormals)."""
    _, size, step, scales = FORMATS[fmt]
    t = memory.zeros(copies, n // 4, k // step, size, dtype=torch.uint8)
    t.copy_(torch.randint(0, 256, t.shape[1:], dtype=torch.uint8).expand_as(t))
    if fmt == "MXFP4":
        t[..., :scales] = 127 - 8  # E8M0: 2^(e - 127)
    else:
        t[..., :scales].view(torch.float16).fill_(2 ** -8)
    return t


def bandwidth(nbytes: float, reps: int) -> float:
    x = memory.zeros(int(nbytes) // 4, dtype=torch.float32)
    x.fill_(1.0)
    x.sum()
    return nbytes / min(timed(lambda: x.sum()) for _ in range(reps)) / 1e9


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--baseline", default="", help="also time the native kernels of this git revision")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "stream")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    builds = {"HEAD": native_ops()}
    if a.baseline:
        builds[short_sha(a.baseline)] = native_kernels_at(a.baseline)
    read = bandwidth(WORKING_SET, a.reps)
    print(f"{a.threads} threads; x.sum() over {WORKING_SET / 1e6:.0f} MB: {read:.1f} GB/s")
    rows = []
    for model, matrices in MATRICES.items():
        for fmt in a.formats.split(","):
            op = FORMATS[fmt][0]
            for n, k in matrices:
                _, size, step, _ = FORMATS[fmt]
                if k % step:  # a shape the format cannot hold (K-quants at gpt-oss's 2880)
                    continue
                one = n // 4 * k // step * size
                ws = tiles(fmt, n, k, max(2, int(WORKING_SET // one)))
                x = torch.randn(1, k)
                calls = {b: (lambda ops=ops: [getattr(ops, op)(x, w, None) for w in ws]) for b, ops in builds.items()
                         if hasattr(ops, op)}  # a baseline from before the format's kernel has none
                samples = {b: [] for b in builds}
                for fn in calls.values():
                    fn()  # warm up
                for _ in range(a.reps):
                    for b, fn in calls.items():
                        samples[b].append(ws.numel() / timed(fn) / 1e9)
                row = {"model": model, "format": fmt, "N": n, "K": k, "MB": round(one / 1e6, 1),
                       "copies": ws.shape[0],
                       **{b: {"median": statistics.median(v), "min": min(v), "max": max(v)} for b, v in samples.items()
                          if v}}
                rows.append(row)
                print(f"{model:<22} {fmt} {n:>6}x{k:<6} {row['MB']:6.1f} MB  "
                      + "  ".join(f"{b} {row[b]['median']:5.1f} GB/s" for b in calls), flush=True)
    commit, dirty = git_state().values()
    report = {"benchmark": "stream", "command": command_line(),
              "machine": machine(), "threads": a.threads, "read_GBps": read, "builds": list(builds), "rows": rows}
    write_json(a.out / "stream.json", report)
    headers = ["model", "format", "N x K", "MB"] + [f"{b} GB/s" for b in builds]
    table = [[r["model"], r["format"], f"{r['N']}x{r['K']}", f"{r['MB']:.1f}"]
             + [f"{r[b]['median']:.1f} ({r[b]['min']:.1f}-{r[b]['max']:.1f})" if b in r else "-" for b in builds]
             for r in rows]
    (a.out / "stream.md").write_text(
        f"# bench/stream.py at {commit[:10]}{' (dirty)' if dirty else ''}\n\n`{report['command']}`\n\n"
        f"One activation row, {a.threads} threads; x.sum() over {WORKING_SET / 1e6:.0f} MB reads {read:.1f} GB/s. "
        f"Median (min-max) of {a.reps} interleaved rounds.\n\n" + markdown_table(headers, table) + "\n")
    print(f"wrote {a.out}/stream.json and stream.md")


if __name__ == "__main__":
    main()
