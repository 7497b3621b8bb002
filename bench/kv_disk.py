"""The prefix cache's disk tier alone: how fast a prompt's blocks are written behind and read back into the pool.

Writes the blocks of a prompt of --tokens tokens with a model shape's KV layout (layers, KV heads, head size; float16)
through a DiskTier into a scratch folder (committed a prefill chunk at a time, each written before the next), then
reads them back into a fresh pool with KVCache.match_prefix, the engine's own path (open, header and token check,
preadv into the pool, CRC-32), --repeats times with the page cache warm and, with --drop-caches (root), cold, as
after a reboot. Writes JSON (with the commit) and a markdown table.

    python bench/kv_disk.py --shape llama-3.1-8b --tokens 20000 --drop-caches
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import command_line, fmt, git_state, machine, markdown_table, stats, write_json  # noqa: E402
from fastdecode.engine.kv_cache import BLOCK_SIZE, BlockTable, KVCache  # noqa: E402
from fastdecode.engine.kv_disk import DiskTier  # noqa: E402
from fastdecode.engine.kv_files import ModelIdentity  # noqa: E402

CHUNK = 2048  # tokens committed at once (a prefill chunk); the writer keeps at most 1 GB of snapshots queued
SHAPES = {"qwen2.5-coder-1.5b": (28, 2, 128), "llama-3.1-8b": (32, 8, 128), "gpt-oss-20b": (24, 8, 64),
          "qwen3-30b-a3b": (48, 4, 128)}  # layers, KV heads, head size (bench/shapes.py)


def pool(shape, tokens: int, root: Path) -> KVCache:
    layers, heads, head_dim = shape
    kv = KVCache(layers, heads, head_dim, -(-tokens // BLOCK_SIZE) + 1, dtype=torch.float16)
    kv.disk = DiskTier(ModelIdentity(b"bench-kv-disk---", {"model": "bench"}), kv.k, kv.v, BLOCK_SIZE, 1 << 50, root)
    return kv


def drop_caches():
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    p.add_argument("--tokens", type=int, default=20000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--drop-caches", action="store_true", help="also read with the page cache emptied (root)")
    p.add_argument("--dir", default=None, help="scratch folder (default: a temporary one under $TMPDIR)")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "kv_disk"))
    a = p.parse_args()

    tokens = list(range(1000, 1000 + a.tokens))
    with tempfile.TemporaryDirectory(dir=a.dir, prefix="fastdecode-kv-bench-") as scratch:
        root = Path(scratch)
        writer = pool(SHAPES[a.shape], a.tokens, root)
        for t in (*writer.k, *writer.v):
            t.normal_()
        table = BlockTable()
        writer.reserve(table, a.tokens)
        t0, snapshot_s = time.perf_counter(), 0.0
        for done in range(CHUNK, a.tokens + CHUNK, CHUNK):  # a chunk at a time, as prefill commits them
            t1 = time.perf_counter()
            writer.commit(table, tokens, min(done, a.tokens))  # snapshots on this thread, files by the writer
            snapshot_s += time.perf_counter() - t1
            writer.disk.flush(timeout=3600)
        write_s = time.perf_counter() - t0
        blocks, file_bytes = writer.disk.written, writer.disk.file_bytes
        runs = {"warm": [], "cold": []}
        for _ in range(a.repeats):
            for kind in ("warm", "cold") if a.drop_caches else ("warm",):
                if kind == "cold":
                    drop_caches()
                reader = pool(SHAPES[a.shape], a.tokens, root)
                t0 = time.perf_counter()
                got = reader.match_prefix(BlockTable(), tokens)
                runs[kind].append(time.perf_counter() - t0)
                assert got == blocks * BLOCK_SIZE, f"read {got} tokens of {blocks * BLOCK_SIZE}"
    size = blocks * file_bytes
    result = {"benchmark": "kv_disk", **git_state(), "command": command_line(), "machine": machine(),
              "shape": a.shape, "tokens": a.tokens, "blocks": blocks, "bytes": size,
              "snapshot_s": snapshot_s, "write_gb_s": size / write_s / 1e9,
              "read_s": {k: stats(v) for k, v in runs.items() if v},
              "read_gb_s": {k: size / stats(v)["median"] / 1e9 for k, v in runs.items() if v}}
    out = Path(a.out)
    write_json(out.with_name(out.name + ".json"), result)
    rows = [[kind, str(len(v)), *(fmt(stats(v)[k], ".3f") for k in ("median", "min", "max")),
             fmt(result["read_gb_s"][kind], ".2f")] for kind, v in runs.items() if v]
    lines = [f"# Disk tier: {a.tokens} tokens of {a.shape}'s KV ({blocks} blocks, {size / 1e9:.2f} GB)", "",
             f"`{command_line()}` at {result['commit'][:10]}{' (dirty)' if result['dirty'] else ''}", "",
             f"Written behind at {result['write_gb_s']:.2f} GB/s (snapshots on the engine thread: {snapshot_s:.2f} s).",
             "", markdown_table(["page cache", "reads", "median s", "min s", "max s", "GB/s (median)"], rows)]
    out.with_name(out.name + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
