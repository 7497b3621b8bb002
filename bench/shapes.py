"""Real-size models on this machine: random-weight GGUFs of real shapes, fastdecode against llama.cpp.

    .venv/bin/python bench/shapes.py                      # Qwen2.5-Coder-1.5B and Llama-3.1-8B shapes, Q4_0 and Q8_0
    .venv/bin/python bench/shapes.py --shapes qwen2.5-coder-1.5b --types Q4_0 --runs 1   # a smoke run
    .venv/bin/python bench/shapes.py --shapes gpt-oss-20b --types MXFP4     # MXFP4 experts, Q8_0 for the rest
    .venv/bin/python bench/shapes.py --shapes '' --files gemma3-270m        # a real file as it is

Decode speed depends on shapes and bytes, not on values, so the files hold random blocks (random codes, scales that
give weights a std of about 0.02) in the real tensor shapes, with SmolLM2's tokenizer padded to the real vocabulary
so that llama.cpp loads them. Q4_K follows llama.cpp's Q4_K_M recipe (`tensor_type`), the file type people download. They are written once into $FASTDECODE_HOME/shapes. Every run is a fresh process (load included), the engines
alternate within each round, and the parent reads each child's peak resident memory (ru_maxrss, from wait4): file
pages that a memory-mapping engine touches count, as they do for the machine. fastdecode's first load of each file
(no weight image yet: it packs the blocks and writes one, loading/weight_image.py) runs before the rounds and has
its own column; in the rounds, both engines load from a warm page cache (llama.cpp maps the GGUF, fastdecode its
image). The roofline is the bandwidth probed before and after the rounds (the faster, at the decode's working set)
over the bytes a decode step reads (decode.py's gguf_info). "imports s" is each engine's Python imports (torch's
~1 s for fastdecode; the bindings for llama.cpp), paid once per process whatever it loads; "load s" is the model's
load after them (`LLM(...)`, `Llama(...)`). Writes shapes.json (with the commit) and shapes.md into --out.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from common import command_line, fmt, fmt_range, git_state, machine, markdown_table, stats, write_json
from decode import bandwidth, bytes_per_token, gguf_info, probe_size

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.helpers


@dataclass(frozen=True)
class Shape:
    arch: str  # GGUF architecture
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool
    rope_theta: float
    eps: float
    qkv_bias: bool = False
    head_dim: int | None = None  # hidden / heads unless given
    qk_norm: bool = False
    experts: int = 0  # mixture of experts: every layer's MLP is `experts` SwiGLUs of width `intermediate`
    experts_used: int = 0  # top-k
    gpt_oss: bool = False  # gpt-oss: biases on attention, router and experts, attention sinks, YaRN, windows of 128

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden // self.heads


SHAPES = {  # from each model's config.json
    "qwen2.5-coder-1.5b": Shape("qwen2", 1536, 8960, 28, 12, 2, 151936, True, 1e6, 1e-6, qkv_bias=True),
    "llama-3.2-3b": Shape("llama", 3072, 8192, 28, 24, 8, 128256, True, 5e5, 1e-5),
    "llama-3.1-8b": Shape("llama", 4096, 14336, 32, 32, 8, 128256, False, 5e5, 1e-5),
    # Qwen3-30B-A3B (Qwen3-Coder-30B-A3B has the same shapes): 128 experts of width 768, 8 routed per token.
    "qwen3-30b-a3b": Shape("qwen3moe", 2048, 768, 48, 32, 4, 151936, False, 1e6, 1e-6, head_dim=128, qk_norm=True,
                           experts=128, experts_used=8),
    # gpt-oss-20b: 32 experts of width 2880, 4 routed per token, every other layer a window of 128 tokens.
    "gpt-oss-20b": Shape("gpt-oss", 2880, 2880, 24, 64, 8, 201088, False, 150000.0, 1e-5, qkv_bias=True, head_dim=64,
                         experts=32, experts_used=4, gpt_oss=True),
}
# The fp16 scale d per GGML type that gives random codes a weight std of about 0.02: Q4_0 d (q - 8), q uniform in
# 0..15 (std 4.6); Q8_0 d q, q uniform int8 (std 74); Q4_K d sc q - dmin m, sc, m in 0..63 and q in 0..15 (std of sc q
# 218; dmin = d); Q6_K d sc (q - 32), sc int8 and q in 0..63 (std 74 * 18.5).
SCALES = {"Q4_0": 0.02 / 4.6, "Q8_0": 0.02 / 74, "Q4_K": 0.02 / 218, "Q6_K": 0.02 / (74 * 18.5)}
# MXFP4: an E8M0 scale byte 2^(e - 127); E2M1 codes uniform over 0, +-0.5, ..., +-6 have a std of 2.9: 2^-7 * 2.9.
MXFP4_SCALE_BYTE = 120
FILE_TYPES = ("Q4_0", "Q8_0", "Q4_K", "MXFP4")  # --types; Q4_K is llama.cpp's Q4_K_M mix, MXFP4 gpt-oss's file
TOKENIZER_SOURCE = "smollm2-135m"


# ---- writing the files -------------------------------------------------------------------------------------------
def tensors(s: Shape):
    """(GGUF name, PyTorch-order shape) of every tensor."""
    head_dim = s.head_size
    yield "token_embd.weight", (s.vocab, s.hidden)
    for i in range(s.layers):
        b = f"blk.{i}"
        yield f"{b}.attn_norm.weight", (s.hidden,)
        if s.qk_norm:
            yield f"{b}.attn_q_norm.weight", (head_dim,)
            yield f"{b}.attn_k_norm.weight", (head_dim,)
        for name, rows in (("attn_q", s.heads * head_dim), ("attn_k", s.kv_heads * head_dim),
                           ("attn_v", s.kv_heads * head_dim)):
            yield f"{b}.{name}.weight", (rows, s.hidden)
            if s.qkv_bias:
                yield f"{b}.{name}.bias", (rows,)
        yield f"{b}.attn_output.weight", (s.hidden, s.heads * head_dim)
        if s.gpt_oss:
            yield f"{b}.attn_output.bias", (s.hidden,)
            yield f"{b}.attn_sinks.weight", (s.heads,)
        yield f"{b}.{'post_attention_norm' if s.gpt_oss else 'ffn_norm'}.weight", (s.hidden,)
        if s.experts:  # the router stays float, as llama.cpp's quantizer leaves it
            yield f"{b}.ffn_gate_inp.weight", (s.experts, s.hidden)
            if s.gpt_oss:
                yield f"{b}.ffn_gate_inp.bias", (s.experts,)
            for name, rows, cols in (("ffn_gate_exps", s.intermediate, s.hidden), ("ffn_up_exps", s.intermediate, s.hidden),
                                     ("ffn_down_exps", s.hidden, s.intermediate)):
                yield f"{b}.{name}.weight", (s.experts, rows, cols)
                if s.gpt_oss:
                    yield f"{b}.{name}.bias", (s.experts, rows)
            continue
        yield f"{b}.ffn_gate.weight", (s.intermediate, s.hidden)
        yield f"{b}.ffn_up.weight", (s.intermediate, s.hidden)
        yield f"{b}.ffn_down.weight", (s.hidden, s.intermediate)
    yield "output_norm.weight", (s.hidden,)
    if not s.tied:
        yield "output.weight", (s.vocab, s.hidden)


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's rule (llama-quant.cpp) for the layers whose attn_v and ffn_down Q4_K_M keeps in Q6_K: the first
    and last eighth, and every third between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def tensor_type(name: str, file_type: str, s: Shape) -> str:
    """The GGML type of matrix `name` in a file of `file_type`. Q4_K is llama.cpp's Q4_K_M for dense models: Q4_K,
    but Q6_K for the output matrix (the token embedding where it is tied: llama.cpp's `!has_output` case) and for
    attn_v and ffn_down where use_more_bits. Q4_0 and Q8_0 files hold every matrix in their type. MXFP4 is gpt-oss's
    file (ggml-org's gpt-oss-20b-mxfp4.gguf): the experts in MXFP4, every other matrix in Q8_0."""
    if file_type == "MXFP4":
        return "MXFP4" if name.split(".")[2:3] in (["ffn_gate_exps"], ["ffn_up_exps"], ["ffn_down_exps"]) else "Q8_0"
    if file_type != "Q4_K":
        return file_type
    if name == "output.weight" or (name == "token_embd.weight" and s.tied):
        return "Q6_K"
    parts = name.split(".")
    if parts[0] == "blk" and parts[2] in ("attn_v", "ffn_down", "ffn_down_exps") and use_more_bits(int(parts[1]), s.layers):
        return "Q6_K"
    return "Q4_K"


def random_blocks(rng, shape, qtype: str) -> np.ndarray:
    """(rows, bytes per row) uint8: random codes, every block's fp16 scales (d, and dmin) about the type's."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    from tests.helpers import kquant_blocks  # the K-quant writer the tests' GGUFs use

    qt = getattr(GGMLQuantizationType, qtype)
    block, block_bytes = GGML_QUANT_SIZES[qt]
    rows, cols = int(np.prod(shape[:-1])), shape[-1]
    if qt in kquant_blocks.K_QUANTS:  # random 6-bit or int8 sub-block scales, d within a factor of 2 of the type's
        d = SCALES[qtype]
        return kquant_blocks.random_blocks(qt, rows * cols // block, rng, (d / 2, d * 2)).reshape(rows, -1)
    raw = np.frombuffer(rng.bytes(rows * cols // block * block_bytes), dtype=np.uint8).reshape(rows, -1, block_bytes)
    raw = raw.copy()
    if qtype == "MXFP4":
        raw[..., 0] = MXFP4_SCALE_BYTE
    else:
        raw[..., :2] = np.frombuffer(np.float16(SCALES[qtype]).tobytes(), dtype=np.uint8)
    return raw.reshape(rows, -1)


def tokenizer_metadata(vocab: int) -> dict:
    """SmolLM2's tokenizer keys, its vocabulary padded with unused tokens to `vocab` entries."""
    from fastdecode.loading.catalog import resolve
    from fastdecode.loading.gguf_file import GGUFFile

    meta = {k: v for k, v in GGUFFile(resolve(TOKENIZER_SOURCE)).metadata.items() if k.startswith("tokenizer.")}
    n = len(meta["tokenizer.ggml.tokens"])
    meta["tokenizer.ggml.tokens"] = meta["tokenizer.ggml.tokens"] + [f"<unused_{i}>" for i in range(vocab - n)]
    meta["tokenizer.ggml.token_type"] = meta["tokenizer.ggml.token_type"] + [5] * (vocab - n)  # 5: UNUSED
    return meta


def write_shape(path: Path, s: Shape, file_type: str, seed: int = 0):
    import gguf

    w = gguf.GGUFWriter(None, s.arch)
    a = s.arch
    for key, value in [("context_length", 32768), ("embedding_length", s.hidden),
                       ("feed_forward_length", s.intermediate), ("block_count", s.layers),
                       ("attention.head_count", s.heads), ("attention.head_count_kv", s.kv_heads),
                       ("rope.dimension_count", s.head_size), ("vocab_size", s.vocab),
                       ("attention.key_length", s.head_size), ("attention.value_length", s.head_size)]:
        w.add_uint32(f"{a}.{key}", value)
    if s.experts:
        for key, value in [("expert_count", s.experts), ("expert_used_count", s.experts_used),
                           ("expert_feed_forward_length", s.intermediate)]:
            w.add_uint32(f"{a}.{key}", value)
    if s.gpt_oss:  # gpt-oss-20b's config.json: YaRN x32 over 4k, windows of 128
        w.add_uint32(f"{a}.attention.sliding_window", 128)
        w.add_string(f"{a}.rope.scaling.type", "yarn")
        w.add_float32(f"{a}.rope.scaling.factor", 32.0)
        w.add_uint32(f"{a}.rope.scaling.original_context_length", 4096)
    w.add_float32(f"{a}.rope.freq_base", s.rope_theta)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", s.eps)
    w.add_string("general.name", f"random {path.stem}")
    for key, value in tokenizer_metadata(s.vocab).items():
        if isinstance(value, list):
            w.add_array(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, bool):
            w.add_bool(key, value)
        else:
            w.add_uint32(key, value)
    if file_type == "Q4_K":
        w.add_uint32("general.file_type", gguf.LlamaFileType.MOSTLY_Q4_K_M)
    specs = [(name, shape, len(shape) > 1 and "ffn_gate_inp" not in name and not name.endswith(".bias") and
              tensor_type(name, file_type, s)) for name, shape in tensors(s)]
    for name, shape, qtype in specs:
        if not qtype:
            w.add_tensor_info(name, shape, np.dtype(np.float32), int(np.prod(shape)) * 4)
        else:
            qt = getattr(gguf.GGMLQuantizationType, qtype)
            block, block_bytes = gguf.GGML_QUANT_SIZES[qt]
            nbytes = int(np.prod(shape)) // block * block_bytes
            w.add_tensor_info(name, (*shape[:-1], shape[-1] // block * block_bytes), np.dtype(np.uint8), nbytes,
                              raw_dtype=qt)
    tmp = path.with_suffix(".tmp")
    w.write_header_to_file(tmp)
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, shape, qtype in specs:  # one tensor in memory at a time
        if qtype:
            w.write_tensor_data(random_blocks(rng, shape, qtype).reshape(*shape[:-1], -1))
        elif name.endswith("ffn_gate_inp.weight"):  # a random router, so that tokens spread over the experts as
            w.write_tensor_data(rng.normal(0, 0.02, shape).astype(np.float32))  # trained ones do
        elif name.endswith(".bias") or "attn_sinks" in name:
            w.write_tensor_data(np.zeros(shape, np.float32))
        else:
            w.write_tensor_data(np.ones(shape, np.float32))
    w.close()
    tmp.rename(path)


def file_type(path: Path) -> str | None:
    """A GGUF's file type as people name it (Q4_K_M), from its header; None where it names none we know."""
    from gguf import LlamaFileType

    from fastdecode.loading.gguf_file import read_gguf

    try:
        return LlamaFileType(read_gguf(path).metadata.get("general.file_type", -1)).name.removeprefix("MOSTLY_")
    except ValueError:
        return None


def shape_file(name: str, qtype: str, log) -> Path:
    from fastdecode.loading.catalog import fastdecode_home

    path = fastdecode_home() / "shapes" / f"{name}-{qtype}.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        log(f"writing {path}")
        write_shape(path, SHAPES[name], qtype)
    return path


# ---- one measured run, in a child process ------------------------------------------------------------------------
def child(engine: str, path: str, prompt_tokens: int, tokens: int, threads: int, max_seq_len: int) -> dict:
    prompt = [int(i) for i in np.random.default_rng(0).integers(100, 40000, prompt_tokens)]  # SmolLM2's ids
    if engine == "fastdecode-first":  # the first load of this file: no weight image yet, this load writes it
        import torch

        from fastdecode.loading import weight_image
        from fastdecode.loading.gguf_file import GGUFFile

        image = weight_image.WeightImage(GGUFFile(path), torch.float32)
        weight_image.remove(image.directory, image.key)
        engine = "fastdecode"
    start = time.perf_counter()
    if engine == "fastdecode":
        from fastdecode import LLM, SamplingParams

        import_s, start = time.perf_counter() - start, time.perf_counter()
        llm = LLM(path, threads=threads, max_seq_len=max_seq_len, speculate="none")
        load_s = time.perf_counter() - start
        c = llm.generate(prompt, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
        llm.close()  # else the process aborts at exit ("terminate called without an active exception", rc 134)
        t = c.timings
        return {"import_s": import_s, "load_s": load_s, "prefill_tok_s": t.prefill_tok_s,
                "decode_tok_s": t.output_tok_s, "tokens": c.token_ids, "decode_path": llm.decode_path}
    import llama_cpp
    from llama_cpp import Llama

    from decode import no_extra_bufts, timed

    if "AMX" in llama_cpp.llama_print_system_info().decode(errors="replace"):
        no_extra_bufts(llama_cpp.llama_cpp)
    import_s, start = time.perf_counter() - start, time.perf_counter()
    llm = Llama(model_path=path, n_ctx=max_seq_len, n_threads=threads, n_threads_batch=threads, seed=0,
                verbose=False)
    load_s = time.perf_counter() - start
    out, times = [], []
    start = time.perf_counter()
    for token in llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
        times.append(time.perf_counter())
        out.append(token)
        if len(out) == tokens:
            break
    r = timed(out, len(prompt), start, times)
    return {"import_s": import_s, "load_s": load_s, "prefill_tok_s": r["prefill_tok_s"],
            "decode_tok_s": r["decode_tok_s"], "tokens": out, "version": llama_cpp.__version__}


def in_child(*argv, args=None) -> dict:
    """This script's answer to `argv`, from a child process. The parent keeps its memory small (it neither probes
    with GB-sized buffers nor parses a vocabulary): Linux carries a process's peak resident memory across fork and
    exec, so every measured child would report the parent's as its own."""
    extra = [] if args is None else ["--threads", str(args.threads), "--prompt-tokens", str(args.prompt_tokens),
                                     "--tokens", str(args.tokens)]
    out = subprocess.run([sys.executable, __file__, *map(str, argv), *extra], capture_output=True, text=True,
                         check=True).stdout
    return json.loads(out.splitlines()[-1])


def probe_bandwidth(threads: int, sizes: list[int]) -> dict:
    probe = in_child("--probe", ",".join(map(str, sizes)), "--threads", threads)
    probe["working_sets"] = {int(k): v for k, v in probe["working_sets"].items()}  # JSON made the sizes strings
    return probe


def describe(name: str, prompt_tokens: int, tokens: int) -> dict:
    """A GGUF (a path or a registered name): its path, file type, and the bytes a decode step reads (the weights,
    and the f16 KV cache, both engines' default, at the timed decode's mean context)."""
    from fastdecode.loading.catalog import resolve

    path = Path(resolve(name))
    info = gguf_info(str(path))
    return {"path": str(path), "file_type": file_type(path) or info["format"],
            "read": bytes_per_token({"engine": "llama.cpp"}, info, prompt_tokens, tokens)}


def measure(engine: str, path: Path, args) -> dict:
    """One fresh process: its result and its peak resident memory."""
    cmd = [sys.executable, __file__, "--child", engine, str(path), "--prompt-tokens", str(args.prompt_tokens),
           "--tokens", str(args.tokens), "--threads", str(args.threads), "--max-seq-len", str(args.max_seq_len)]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True)
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own rusage (Popen.wait would reap it without)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0), err.seek(0)
        out, err = out.read(), err.read()
    peak = usage.ru_maxrss * 1024  # kilobytes on Linux
    lines = [line for line in out.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"error": (err.strip().splitlines() or ["no output"])[-1], "peak_rss_bytes": peak}
    return {**json.loads(lines[-1]), "peak_rss_bytes": peak}


# ---- the benchmark ---------------------------------------------------------------------------------------------
def llama_cpp_installed() -> bool:
    try:
        import llama_cpp  # noqa: F401
        return True
    except ImportError:
        return False


def summarize(results: dict, files: dict, engines: list[str], first_loads: dict, reads: dict,
              probes: list[dict]) -> list[dict]:
    rows = []
    for (name, qtype), by_engine in results.items():
        size = files[(name, qtype)].stat().st_size
        read = reads[(name, qtype)]  # bytes a decode step reads; the ceiling is the bandwidth at that working set
        roofline = max(p["working_sets"][probe_size(read)] for p in probes) * 1e9 / read
        for engine in engines:
            runs = [r for r in by_engine[engine] if "error" not in r]
            row = {"shape": name, "type": qtype, "engine": engine, "file_bytes": size, "runs": by_engine[engine],
                   "errors": [r["error"] for r in by_engine[engine] if "error" in r]}
            if engine == "fastdecode":
                row["first_load"] = first_loads[(name, qtype)]
                row["first_load_s"] = first_loads[(name, qtype)].get("load_s")
            for key in ("import_s", "load_s", "prefill_tok_s", "decode_tok_s", "peak_rss_bytes"):
                row[key] = stats([r[key] for r in runs if r.get(key) is not None])
            peak = row["peak_rss_bytes"]["median"]
            row["peak_rss_over_file"] = peak / size if peak else None
            row.update(bytes_per_token=read, roofline_tok_s=roofline, roofline_pct=(
                100 * row["decode_tok_s"]["median"] / roofline if row["decode_tok_s"]["median"] else None))
            rows.append(row)
        ours = next(r for r in rows[-len(engines):] if r["engine"] == "fastdecode")
        peer = next((r for r in rows[-len(engines):] if r["engine"] == "llama.cpp"), None)
        if peer and ours["decode_tok_s"]["median"] and peer["decode_tok_s"]["median"]:
            ours["decode_vs_llama_cpp"] = ours["decode_tok_s"]["median"] / peer["decode_tok_s"]["median"]
    return rows


def render(rows: list[dict]) -> str:
    gb = lambda s: {k: (v / 1e9 if isinstance(v, (int, float)) else v) for k, v in s.items()}  # noqa: E731
    table = [[r["shape"], r["type"], f"{r['file_bytes'] / 1e9:.2f}", r["engine"],
              fmt_range(r["import_s"], ".2f"), fmt(r.get("first_load_s"), ".1f"), fmt_range(r["load_s"], ".2f"),
              fmt_range(gb(r["peak_rss_bytes"]), ".2f"), fmt(r["peak_rss_over_file"], ".2f"),
              fmt_range(r["prefill_tok_s"]), fmt_range(r["decode_tok_s"], ".2f"),
              fmt(r.get("decode_vs_llama_cpp"), ".2f"), fmt(r["roofline_tok_s"], ".2f"),
              fmt(r["roofline_pct"], ".0f")] for r in rows]
    return markdown_table(["shape", "type", "file GB", "engine", "imports s", "first load s", "load s", "peak RSS GB",
                           "RSS / file", "prefill tok/s", "decode tok/s", "decode vs llama.cpp", "roofline tok/s",
                           "% roofline"], table)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="qwen2.5-coder-1.5b,llama-3.1-8b", help=f"of {', '.join(SHAPES)}")
    p.add_argument("--types", default="Q4_0,Q8_0", help=f"of {', '.join(FILE_TYPES)}")
    p.add_argument("--files", default="", help="real GGUF files, run as they are (a registered name or a path: "
                   "gemma3-270m)")
    p.add_argument("--runs", type=int, default=3, help="rounds; within each, every engine runs every file once")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--tokens", type=int, default=64, help="greedy tokens decoded per run")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-seq-len", type=int, default=512, help="KV cache length of both engines")
    p.add_argument("--peers", default="llama.cpp", help="'' for fastdecode alone")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    p.add_argument("--child", nargs=2, metavar=("ENGINE", "PATH"), help=argparse.SUPPRESS)
    p.add_argument("--probe", help=argparse.SUPPRESS)
    p.add_argument("--describe", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(*args.child, args.prompt_tokens, args.tokens, args.threads, args.max_seq_len)))
        return
    if args.probe:
        print(json.dumps(bandwidth(args.threads, [int(s) for s in args.probe.split(",")])))
        return
    if args.describe:
        print(json.dumps(describe(args.describe, args.prompt_tokens, args.tokens)))
        return
    engines = ["fastdecode"] + [e for e in args.peers.split(",") if e == "llama.cpp" and llama_cpp_installed()]
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    configs = [(s, t) for s in filter(None, args.shapes.split(",")) for t in args.types.split(",")]
    files = {c: shape_file(*c, log) for c in configs}
    reads = {c: in_child("--describe", files[c], args=args)["read"] for c in configs}
    for name in filter(None, args.files.split(",")):
        about = in_child("--describe", name, args=args)
        c = (name, about["file_type"])
        configs.append(c)
        files[c], reads[c] = Path(about["path"]), about["read"]
    results = {c: {e: [] for e in engines} for c in configs}
    probes = [probe_bandwidth(args.threads, list(reads.values()))]
    first_loads = {}
    for c in configs:  # fastdecode's first load packs the file's blocks into its weight image; every later one maps it
        first_loads[c] = measure("fastdecode-first", files[c], args)
        log(f"first load {c[0]} {c[1]} fastdecode: {first_loads[c].get('load_s', 0):.3g} s, peak RSS "
            f"{first_loads[c]['peak_rss_bytes'] / 1e9:.2f} GB" + (f", error {first_loads[c]['error']}"
                                                                 if "error" in first_loads[c] else ""))
    for i in range(args.runs):
        for c in configs:
            for engine in engines:
                r = measure(engine, files[c], args)
                log(f"round {i + 1}/{args.runs} {c[0]} {c[1]} {engine}: " + ", ".join(
                    f"{k} {r[k]:.3g}" for k in ("load_s", "prefill_tok_s", "decode_tok_s") if r.get(k))
                    + f", peak RSS {r['peak_rss_bytes'] / 1e9:.2f} GB" + (f", error {r['error']}" if "error" in r
                                                                          else ""))
                results[c][engine].append(r)
    probes.append(probe_bandwidth(args.threads, list(reads.values())))  # the faster of before and after the rounds
    rows = summarize(results, files, engines, first_loads, reads, probes)
    commit, dirty = git_state().values()
    table = render(rows)
    report = {"command": command_line(), "machine": machine(), "args": {
        k: str(v) for k, v in vars(args).items() if k != "child"}, "bandwidth_probes": probes, "rows": rows}
    write_json(args.out / "shapes.json", report)
    (args.out / "shapes.md").write_text(f"# bench/shapes.py at {commit[:10]}{' (dirty)' if dirty else ''}\n\n"
                                        f"`{command_line()}`\n\n{table}\n")
    print(table)


if __name__ == "__main__":
    main()
