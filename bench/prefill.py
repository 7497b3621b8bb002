"""Prefill against its ceiling: time to first token for prompts of 512 to 32k tokens on real shapes, fastdecode beside
llama.cpp in alternating runs, in tok/s and as a share of this machine's compute ceiling, with where fastdecode's
time goes (matmuls, attention, the rest).

    .venv/bin/python bench/prefill.py                                   # 1.5B and 8B shapes, Q4_0, 512 .. 8k tokens
    .venv/bin/python bench/prefill.py --shapes qwen2.5-coder-1.5b --lengths 512 --runs 1 --peers ''   # a smoke run
    .venv/bin/python bench/prefill.py --shapes llama-3.1-8b --types Q4_0,Q4_K --lengths 2048
    .venv/bin/python bench/prefill.py --shapes qwen2.5-coder-1.5b --lengths 512,2048,8192,32000 --runs 1   # not 32768:
                                                                    # the 32k context must hold one more token
    .venv/bin/python bench/prefill.py --baseline-env FASTDECODE_BF16_ATTENTION=0 --peers ''   # A/B a kernel switch
    .venv/bin/python bench/prefill.py --shapes gemma3-270m --lengths 2048,8192,20000   # a pulled real model

The files are bench/shapes.py's random-weight GGUFs of real shapes (speed depends on shapes and bytes, not values).
Each run of an engine is a fresh process that loads the file, prefills a 64-token prompt to warm up, then each length
in turn: a prompt of random token ids drawn anew per run (nothing is found in a prefix cache; fastdecode's disk tier
is off) timed from the call to the first token (fastdecode `generate(max_tokens=1)`; llama.cpp `eval`, flash
attention on, batches of 512). The engines alternate within each round, and their order flips every round.

The ceiling is the matrix peak that `fastdecode probe` measures: for the quantized formats (their kernels multiply int8
activations by integer weights) the faster of torch's int8 GEMM and the int8 instructions of the path the kernels take
(AMX, VNNI or AVX2, in registers: roofline.probe.int8_peak); bf16 (torch's GEMM) beside it; over the prompt's
FLOPs: 2 per weight per token, causal attention (QK^T and PV), the LM head for the last row only
(roofline.calc.prefill_ceiling). fastdecode's breakdown comes from its forward's own clock (kernels
`forward_profile`): matmuls, attention, and the rest (norms, rotary, cache writes, activations) of the forward
passes; "outside" is the rest of the TTFT (scheduling, embedding, the LM head, sampling).

Writes prefill.json (with the commit) and prefill.md into --out.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from common import command_line, fmt, fmt_range, git_state, machine, markdown_table, stats, write_json
from shapes import SHAPES, file_type, shape_file

from fastdecode.loading.catalog import resolve
from fastdecode.roofline.probe import describe_peaks, int8_peak

WARMUP_TOKENS = 64
VOCAB_IDS = (100, 40000)  # SmolLM2's tokenizer, which the shape files carry


def prompt(tokens: int, seed: int) -> list[int]:
    return [int(i) for i in np.random.default_rng(seed).integers(*VOCAB_IDS, tokens)]


# ---- one engine's run, in a child process ------------------------------------------------------------------------
def child_fastdecode(path: str, lengths: list[int], seed: int, threads: int) -> dict:
    from fastdecode import LLM, SamplingParams
    from fastdecode.kernels import native_ops

    llm = LLM(path, threads=threads, max_seq_len=max(lengths) + 8, speculate="none", kv_disk_gb=0)
    ops = native_ops()
    one = SamplingParams(max_tokens=1, temperature=0.0)
    llm.generate(prompt(WARMUP_TOKENS, seed + 1000), one)
    out = {}
    for n in lengths:
        ops.forward_profile(True)
        start = time.perf_counter()
        c = llm.generate(prompt(n, seed * 100 + n), one)
        ttft = time.perf_counter() - start
        calls, rows, matmul, attention, forward = ops.forward_profile(True)
        assert c.timings.cached_tokens == 0, "a timed prompt was found in the prefix cache"
        out[n] = {"ttft_s": ttft, "tok_s": n / ttft, "steps": int(calls), "matmul_s": matmul, "attention_s": attention,
                  "other_s": forward - matmul - attention, "outside_s": ttft - forward}
    llm.close()
    return {"lengths": out, "decode_path": llm.decode_path, "amx": bool(ops.amx_int8_ready())}


def child_llama_cpp(path: str, lengths: list[int], seed: int, threads: int) -> dict:
    import llama_cpp
    from llama_cpp import Llama

    from decode import no_extra_bufts

    if "AMX" in llama_cpp.llama_print_system_info().decode(errors="replace"):
        no_extra_bufts(llama_cpp.llama_cpp)  # its AMX path crashes on batches of 8 or more here (PERF_NOTES.md)
    llm = Llama(model_path=path, n_ctx=max(lengths) + 8, n_threads=threads, n_threads_batch=threads, n_batch=512,
                n_ubatch=512, flash_attn=True, seed=0, verbose=False)
    llm.eval(prompt(WARMUP_TOKENS, seed + 1000))
    out = {}
    for n in lengths:
        llm.reset()
        ids = prompt(n, seed * 100 + n)
        start = time.perf_counter()
        llm.eval(ids)
        ttft = time.perf_counter() - start
        out[n] = {"ttft_s": ttft, "tok_s": n / ttft}
    return {"lengths": out, "version": llama_cpp.__version__}


def in_child(engine: str, path: Path, lengths: list[int], seed: int, threads: int) -> dict:
    """engine: "fastdecode", "llama.cpp", or "fastdecode VAR=VALUE" (fastdecode with that environment variable)."""
    name, _, setting = engine.partition(" ")
    env = dict(os.environ, **dict([setting.split("=", 1)])) if setting else None
    argv = [sys.executable, __file__, "--child", name, "--file", str(path), "--lengths", ",".join(map(str, lengths)),
            "--seed", str(seed), "--threads", str(threads)]
    done = subprocess.run(argv, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{engine} on {path.name} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.splitlines()[-1])


# ---- the parent ----------------------------------------------------------------------------------------------------
def matmul_peaks(threads: int) -> dict:
    code = ("import json; from fastdecode.roofline.probe import measure_matmul; "
            f"print(json.dumps(measure_matmul({threads}, n=2048)))")
    return json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                     check=True).stdout.splitlines()[-1])


def ceilings(path: Path, lengths: list[int], peaks: dict) -> dict:
    from fastdecode.roofline.calc import prefill_ceiling
    from fastdecode.roofline.models import get_model

    spec = get_model(str(path))
    tops = {"int8": int8_peak(peaks)[0], "bf16": peaks.get("bf16", 0.0)}
    return {n: {p: prefill_ceiling(spec, n, 0, v) for p, v in tops.items() if v} for n in lengths}


def bench_files(shapes: list[str], types: list[str]) -> list[tuple[str, str, Path]]:
    """(name, file type, path): each shape in each type (bench/shapes.py writes them), a real model once as it is."""
    files = []
    for shape in shapes:
        if shape in SHAPES:
            files += [(shape, qtype, shape_file(shape, qtype, print)) for qtype in types]
        else:
            path = resolve(shape)
            files.append((shape, file_type(path) or "file", path))
    return files


def have_llama_cpp() -> bool:
    return subprocess.run([sys.executable, "-c", "import llama_cpp"], capture_output=True).returncode == 0


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="qwen2.5-coder-1.5b,llama-3.1-8b",
                   help=f"of {', '.join(SHAPES)}; or a real model: a registered name (gemma3-270m) or a GGUF's path")
    p.add_argument("--types", default="Q4_0", help="GGUF file types (bench/shapes.py): Q4_0, Q8_0, Q4_K, MXFP4")
    p.add_argument("--lengths", default="512,2048,8192",
                   help="prompt tokens (32000 takes minutes a run; the context must hold one token more)")
    p.add_argument("--runs", type=int, default=2, help="rounds; each runs every engine once per file")
    p.add_argument("--peers", default="llama.cpp", help="'llama.cpp' (llama-cpp-python, `make bench-deps`) or ''")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--baseline-env", default="", help="VAR=VALUE: also run fastdecode with it set, alternating "
                   "(an A/B of a kernel switch, e.g. FASTDECODE_BF16_ATTENTION=0)")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "prefill")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--file", help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    lengths = [int(n) for n in args.lengths.split(",") if n]
    if args.child:
        run = child_fastdecode if args.child == "fastdecode" else child_llama_cpp
        print(json.dumps(run(args.file, lengths, args.seed, args.threads)))
        return

    engines = (["fastdecode"] + ([f"fastdecode {args.baseline_env}"] if args.baseline_env else [])
               + (["llama.cpp"] if "llama.cpp" in args.peers.split(",") else []))
    if "llama.cpp" in engines and not have_llama_cpp():
        sys.exit("llama-cpp-python is not installed: `make bench-deps`, or --peers ''")
    files = bench_files([s for s in args.shapes.split(",") if s], [t for t in args.types.split(",") if t])
    peaks = matmul_peaks(args.threads)
    print(f"matrix peaks: {'; '.join(describe_peaks(peaks))}", flush=True)
    results = {f"{shape}-{qtype}": {"file": str(path), "ceiling_tok_s": ceilings(path, lengths, peaks),
                                    "runs": {e: [] for e in engines}} for shape, qtype, path in files}
    for r in range(args.runs):
        for shape, qtype, path in files:
            for engine in engines if r % 2 == 0 else engines[::-1]:
                run = in_child(engine, path, lengths, seed=r, threads=args.threads)
                results[f"{shape}-{qtype}"]["runs"][engine].append(run)
                print(f"round {r + 1}: {shape} {qtype} {engine}: " + ", ".join(
                    f"{n} tok {v['tok_s']:.1f} tok/s" for n, v in run["lengths"].items()), flush=True)

    rows = []
    for name, res in results.items():
        for n in lengths:
            ceil = res["ceiling_tok_s"][n]
            for engine, runs in res["runs"].items():
                speeds = stats([run["lengths"][str(n)]["tok_s"] for run in runs])
                res.setdefault("summary", {}).setdefault(engine, {})[n] = speeds
                split = ""
                if engine.startswith("fastdecode"):
                    parts = {k: np.median([run["lengths"][str(n)][k] for run in runs])
                             for k in ("ttft_s", "matmul_s", "attention_s", "other_s", "outside_s")}
                    split = " / ".join(f"{100 * parts[k] / parts['ttft_s']:.0f}"
                                       for k in ("matmul_s", "attention_s", "other_s", "outside_s"))
                rows.append([name, str(n), engine, fmt_range(speeds), fmt(speeds["median"] and n / speeds["median"]),
                             fmt(ceil.get("int8"), ",.0f"),
                             fmt(ceil.get("int8") and 100 * speeds["median"] / ceil["int8"], ".0f"),
                             fmt(ceil.get("bf16") and 100 * speeds["median"] / ceil["bf16"], ".0f"), split or "-"])
    table = markdown_table(["file", "prompt", "engine", "tok/s median (min-max)", "TTFT s", "ceiling int8 tok/s",
                            "% of int8", "% of bf16", "matmul / attention / rest / outside %"], rows)
    doc = {"command": command_line(), "machine": machine(), "matrix_peaks_tflops": peaks, "lengths": lengths,
           "runs": args.runs, "results": results}
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / "prefill.json", doc)
    state = git_state()
    (args.out / "prefill.md").write_text(
        f"# Prefill against the compute ceiling\n\n`{command_line()}` at {state['commit'][:7]}"
        f"{' (dirty)' if state['dirty'] else ''}, {machine()['cpu']}, {args.threads} threads; matrix peaks: "
        f"{'; '.join(describe_peaks(peaks))}.\n\n{table}\n")
    print(table)


if __name__ == "__main__":
    main()
