"""Quality benchmark: every weight format of one model side by side against its float32 self.

    python bench/quality.py                  # SmolLM2-135M, 8192 corpus tokens; writes bench/results/quality.{json,md}
    python bench/quality.py --tokens 2048 --rows int8,mxfp4 --out /tmp/q

Per row: perplexity on the CPython stdlib corpus (fastdecode.eval: fixed windows of 512 tokens from evenly spaced
files), top-1 agreement with the float32 model's next token at the same positions, greedy agreement on four fixed
code prompts (tokens equal before the first difference, of 32), output tok/s of those greedy runs (decode only,
median over the prompts) and the weight bytes one decode step reads. The float32 model is the reference; for the
registered SmolLM2 that is its Q4_1 GGUF dequantized, so int4-g32 and gguf-q4_1 hold exactly its weights and differ
from it only by the int4 kernel's int8 rounding of activations. Quality figures are deterministic; speeds depend on the
machine's load (recorded in the JSON).
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
from pathlib import Path

from common import command_line, fmt, machine, markdown_table, write_json

# name -> (dtype, quant, group_size, what the weights are)
ROWS = {
    "fp32": ("float32", "none", 32, "float32"),
    "bf16": ("bfloat16", "none", 32, "bfloat16"),
    "int8": ("float32", "int8", 32, "8-bit, fp16 scale and offset per 32 (Q8_0 where it fits better)"),
    "int4-g32": ("float32", "int4", 32, "int4 asymmetric, groups of 32 (Q4_1 layout)"),
    "int4-g128": ("float32", "int4", 128, "int4 asymmetric, groups of 128"),
    "mxfp4": ("float32", "mxfp4", 32, "MXFP4: E2M1, E8M0 scale per 32"),
    "nvfp4": ("float32", "nvfp4", 32, "NVFP4: E2M1, E4M3 scale per 16, fp32 per tensor"),
    "gguf-q4_1": ("float32", "gguf", 32, "the GGUF's own Q4_1 blocks (Q8_0 head), kept as they are"),
}
MODEL = "smollm2-135m"


def lm_head(quant: str) -> str:
    if quant == "none":
        return "float"
    return "file's Q8_0" if quant == "gguf" else "int8"


def path_label(result: dict, quant: str) -> str:
    if result["decode_path"] == "native":
        return "native C++ step"
    if quant in ("mxfp4", "nvfp4", "int4"):
        from fastdecode.quant.linear import lut_ops
        return "PyTorch + 4-bit LUT kernel" if lut_ops() is not None else "PyTorch, dequantize per step"
    return "PyTorch"


def run(args) -> dict:
    import torch

    from fastdecode.engine.llm import LLM
    from fastdecode.eval import EvalConfig, evaluate, max_seq_len, reference
    from fastdecode.eval.fidelity import compare

    torch.set_num_threads(args.threads)
    config = EvalConfig(tokens=args.tokens, window=args.window, greedy_tokens=args.greedy_tokens)
    started = machine()
    print(f"reference: {args.model} float32, {config.n_windows} windows of {config.window} tokens", file=sys.stderr)
    ref = reference(args.model, config, args.threads)
    rows = []
    for name in args.rows:
        dtype, quant, group_size, weights = ROWS[name]
        print(f"{name} ...", file=sys.stderr, flush=True)
        if name == "fp32":  # the reference itself: its own scores and greedy runs
            result = {**compare(ref.scores, ref.scores, ref.runs, ref.runs), "bytes_per_token": ref.bytes_per_token,
                      "reference_bytes_per_token": ref.bytes_per_token, "decode_path": ref.decode_path}
        else:
            llm = LLM(args.model, dtype=dtype, quant=quant, group_size=group_size, threads=args.threads,
                      max_seq_len=max_seq_len(config))
            result = evaluate(llm, ref, label=name)
            result.pop("corpus")
            del llm
        rows.append({"name": name, "dtype": dtype, "quant": quant,
                     "group_size": group_size if quant == "int4" else None, "weights": weights, "lm_head": lm_head(quant), "path": path_label(result, quant), **result})
        print(f"  ppl {result['perplexity']:.3f} top1 {result['top1_agreement']:.4f} "
              f"tok/s {result['output_tok_s']:.1f}", file=sys.stderr)
        gc.collect()
    load_end = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return {"machine": {**started, "load_avg_1m_at_end": load_end}, "command": command_line(), "model": args.model,
            "threads": args.threads, "config": {"tokens": args.tokens, "window": args.window,
                                                "greedy_tokens": args.greedy_tokens, "prompts": list(config.prompts)},
            "corpus": ref.corpus(), "rows": rows}


def table(data: dict) -> str:
    headers = ["format", "weights", "LM head", "decode", "perplexity", "vs fp32", "top-1 agreement",
               "greedy agreement", "output tok/s", "MB per token"]
    out = []
    for r in data["rows"]:
        out.append([r["name"], r["weights"], r["lm_head"], r["path"], f"{r['perplexity']:.3f}",
                    f"{100 * (r['perplexity'] / r['reference_perplexity'] - 1):+.2f}%",
                    f"{100 * r['top1_agreement']:.2f}%",
                    f"{100 * r['greedy_agreement']:.0f}% ({'/'.join(map(str, r['greedy_agreement_tokens']))})",
                    fmt(r["output_tok_s"]), f"{r['bytes_per_token'] / 1e6:.1f}"])
    return markdown_table(headers, out)


def markdown(data: dict) -> str:
    m, c = data["machine"], data["config"]
    corpus = data["corpus"]
    return "\n".join([
        f"# Quality: {data['model']}, every weight format against float32",
        "",
        f"`{data['command']}`",
        "",
        table(data),
        "",
        f"- Corpus: {corpus['windows']} windows of {corpus['window']} tokens from the Python {corpus['python']} "
        f"standard library ({', '.join(corpus['files'])}); {data['rows'][0]['scored_tokens']} scored positions.",
        f"- Greedy agreement: tokens equal to float32's before the first difference, of {c['greedy_tokens']}, on "
        f"{len(c['prompts'])} fixed prompts; output tok/s is the median of those runs ({data['threads']} threads).",
        "- MB per token: weight bytes one decode step reads (every matrix once, the embedding one row).",
        "- MXFP4, NVFP4 and int4 with groups of 128 have no native decode step: inside PyTorch's forward, each matrix "
        "is an AVX2 lookup kernel over the 4-bit codes for decode (float activations) and dequantize-then-GEMM for "
        "prefill (here, the corpus windows).",
        f"- Machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}; load average "
        f"{fmt(m['load_avg_1m_at_start'], '.1f')} at the start, {fmt(m['load_avg_1m_at_end'], '.1f')} at the end "
        "(a busy, shared machine slows the speeds, not the quality figures).",
        "",
    ])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated subset of {','.join(ROWS)}")
    parser.add_argument("--tokens", type=int, default=8192, help="corpus token budget")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--greedy-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    args.rows = [r for r in args.rows.split(",") if r]
    unknown = [r for r in args.rows if r not in ROWS]
    if unknown:
        parser.error(f"unknown rows {unknown}; known: {list(ROWS)}")
    data = run(args)
    write_json(args.out / "quality.json", data)
    (args.out / "quality.md").write_text(markdown(data))
    print(table(data))


if __name__ == "__main__":
    main()
