"""Decode benchmark: greedy decode on one model, fastdecode in each weight format beside its peers, in one run.

    python bench/decode.py            # 3 timed runs of 256 tokens, 2 threads; writes bench/results/decode.{json,md}
    python bench/decode.py --quick    # smoke run: 1 run of 32 tokens; writes bench/results/decode-quick.{json,md}
    python bench/decode.py --baseline HEAD~1 --peers ''   # this tree against the previous commit, interleaved

Every engine gets the same token ids: a ~600-token code-editing request through the model's chat template. One
generation gives prefill tok/s (the prompt) and output tok/s (decode only: the first token belongs to TTFT). Each
engine lives in its own worker process (no two OpenMP pools spin against each other, and a crash such as llama.cpp's
AMX fault loses one row, not the run); engines are warmed up once, then timed round-robin, A B C A B C, so drift
on a shared machine falls on all of them alike. Missing engines are skipped with a note.
"""
from __future__ import annotations

import argparse
import inspect
import multiprocessing as mp
import os
import sys
import time
import traceback
from pathlib import Path

from common import (command_line, fmt, fmt_range, machine, markdown_table, package_at, short_sha, stats,
                    write_json)

CODE = '''\
import json
from dataclasses import dataclass, field


@dataclass
class Item:
    name: str
    price: float
    quantity: int = 1


@dataclass
class Cart:
    items: list = field(default_factory=list)
    discount_codes: dict = field(default_factory=dict)

    def add(self, name, price, quantity=1):
        for item in self.items:
            if item.name == name:
                item.quantity += quantity
                return item
        item = Item(name, price, quantity)
        self.items.append(item)
        return item

    def remove(self, name, quantity=1):
        for item in self.items:
            if item.name == name:
                item.quantity -= quantity
                if item.quantity <= 0:
                    self.items.remove(item)
                return
        raise KeyError(name)

    def subtotal(self):
        total = 0
        for item in self.items:
            total += item.price
        return total

    def apply_discount(self, code):
        percent = self.discount_codes.get(code, 0)
        return self.subtotal() * (1 - percent / 100)

    def to_json(self):
        return json.dumps({"items": [item.__dict__ for item in self.items]})

    @classmethod
    def from_json(cls, text):
        data = json.loads(text)
        cart = cls()
        for entry in data["items"]:
            cart.add(entry["name"], entry["price"], entry["quantity"])
        return cart


def most_expensive(cart, n=3):
    ranked = sorted(cart.items, key=lambda item: item.price)
    return ranked[:n]


def receipt(cart, code=None):
    lines = []
    for item in cart.items:
        lines.append(item.name + " x" + str(item.quantity) + ": " + str(item.price * item.quantity))
    total = cart.apply_discount(code) if code else cart.subtotal()
    lines.append("TOTAL: " + str(round(total, 2)))
    return "\\n".join(lines)
'''
PROMPT = ("Here is a Python module for a shopping cart.\n\n```python\n" + CODE + "```\n\n"
          "`subtotal` ignores the quantity of each item and `most_expensive` returns the cheapest items. Fix both "
          "bugs, add type hints to every function, and return the corrected module in one code block.")
MODEL = "smollm2-135m"
FORMATS = ("gguf", "fp32", "bf16", "int8", "int4")
PEERS = ("transformers", "llama.cpp")
REFERENCE = ("transformers", "fp32")  # greedy tokens every row is checked against


# ---- engines: each is built in its own worker process and times one greedy generation per run() ----------------
class Fastdecode:
    SETTINGS = {"gguf": ("float32", "gguf"), "fp32": ("float32", "none"), "bf16": ("bfloat16", "none"),
                "int8": ("float32", "int8"), "int4": ("float32", "int4")}  # gguf: the file's own formats (default)

    def __init__(self, fmt, model, threads, max_seq_len):
        from fastdecode import LLM, SamplingParams

        dtype, quant = self.SETTINGS[fmt]
        if quant != "none":
            import fastdecode.quant  # noqa: F401  (written alongside; its absence is a skip, not a crash)
        self.params = SamplingParams
        # Every run prefills the whole prompt: a prefix-cache hit on the repeated prompt would time nothing.
        no_cache = {"prefix_cache": False} if "prefix_cache" in inspect.signature(LLM).parameters else {}
        self.llm = LLM(model, dtype=dtype, quant=quant, group_size=32, threads=threads, max_seq_len=max_seq_len,
                       **no_cache)
        self.weight_bytes = self.llm.weight_bytes_per_token()
        self.kv_bytes_per_position = self.llm.kv_bytes_per_token(1)
        # Which code decodes: the C++ whole-model step where the format allows it, else PyTorch's forward.
        self.decode_path = getattr(self.llm, "decode_path", None)  # (older revisions, timed with --baseline, lack it)

    def run(self, prompt_ids, tokens):
        c = self.llm.generate(prompt_ids, self.params(max_tokens=tokens, temperature=0.0, ignore_eos=True))
        t = c.timings
        return {"tokens": c.token_ids, "prompt_tokens": t.prompt_tokens, "ttft_s": t.ttft_s,
                "prefill_tok_s": t.prefill_tok_s, "decode_tok_s": t.output_tok_s}


class Transformers:
    """`generate()` on the same GGUF (dequantized by transformers), timed per token through a streamer."""

    def __init__(self, fmt, model, threads, max_seq_len):
        os.environ["TQDM_DISABLE"] = "1"  # its GGUF dequantization bar would scribble over our progress display
        import torch
        import transformers
        from transformers import AutoModelForCausalLM

        from fastdecode.loading.catalog import resolve

        torch.set_num_threads(threads)
        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
        path = resolve(model)
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[fmt]
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype).eval()
        # No EOS: run through it as the other engines do (min_new_tokens would mask it and change the tokens).
        self.model.generation_config.eos_token_id = None
        c = self.model.config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        element = torch.finfo(dtype).bits // 8
        self.weight_bytes = sum(p.nbytes for p in self.model.parameters())  # tied embedding counted once: the LM head
        self.kv_bytes_per_position = 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * element
        self.version = transformers.__version__

    def run(self, prompt_ids, tokens):
        times = []

        class Streamer:  # put() gets the prompt first, then each new token as it is sampled
            def put(self, value):
                times.append(time.perf_counter())

            def end(self):
                pass

        ids = self.torch.tensor([prompt_ids])
        start = time.perf_counter()
        with self.torch.inference_mode():
            out = self.model.generate(ids, attention_mask=self.torch.ones_like(ids), max_new_tokens=tokens,
                                      do_sample=False, temperature=None, top_p=None, top_k=None, pad_token_id=0,
                                      streamer=Streamer())
        generated = times[1:]
        return timed(out[0, len(prompt_ids):].tolist(), len(prompt_ids), start, generated)


class LlamaCpp:
    """llama-cpp-python's token generator on the GGUF as is (plain decode, no draft), timed per token."""

    def __init__(self, fmt, model, threads, max_seq_len):
        import llama_cpp
        from llama_cpp import Llama

        from fastdecode.loading.catalog import resolve

        self.system_info = llama_cpp.llama_print_system_info().decode(errors="replace")
        if "AMX" in self.system_info:  # its AMX buffers crash on batches of 8+ tokens (shared/PERF_NOTES.md)
            no_extra_bufts(llama_cpp.llama_cpp)
        self.llama_cpp = llama_cpp
        self.llm = Llama(model_path=str(resolve(model)), n_ctx=max_seq_len, n_threads=threads,
                         n_threads_batch=threads, seed=0, verbose=False)
        self.version = llama_cpp.__version__

    def run(self, prompt_ids, tokens):
        self.llm.reset()  # else it reuses the cached prompt prefix and skips prefill
        perf = getattr(self.llama_cpp, "llama_perf_context_reset", None)
        if perf:
            perf(self.llm.ctx)
        out, times = [], []
        start = time.perf_counter()
        for token in self.llm.generate(prompt_ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
            times.append(time.perf_counter())
            out.append(token)
            if len(out) == tokens:
                break
        result = timed(out, len(prompt_ids), start, times)
        if hasattr(self.llama_cpp, "llama_perf_context"):  # llama.cpp's own count: eval only, no Python, no sampling
            data = self.llama_cpp.llama_perf_context(self.llm.ctx)
            result["own_decode_tok_s"] = data.n_eval / (data.t_eval_ms / 1e3) if data.t_eval_ms else None
            result["own_prefill_tok_s"] = data.n_p_eval / (data.t_p_eval_ms / 1e3) if data.t_p_eval_ms else None
        return result


def no_extra_bufts(lib):
    """Loads models with use_extra_bufts=False. It is a field of the model parameters, and Llama(**kwargs) drops
    unknown keywords silently (0.3.36), so it is set where Llama() gets its defaults."""
    default = lib.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = False
        return p

    lib.llama_model_default_params = params


def timed(tokens, prompt_tokens, start, times):
    """Our definitions from per-token timestamps: TTFT to the first token, output tok/s over the rest."""
    ttft = times[0] - start
    decode = times[-1] - times[0]
    return {"tokens": tokens, "prompt_tokens": prompt_tokens, "ttft_s": ttft, "prefill_tok_s": prompt_tokens / ttft,
            "decode_tok_s": (len(times) - 1) / decode if decode > 0 else None}


ENGINES = {"fastdecode": Fastdecode, "transformers": Transformers, "llama.cpp": LlamaCpp}


def worker(conn, engine, fmt, model, threads, max_seq_len, source=None):
    """Builds one engine, reports what it reads per token, then serves run requests until sent None. `source`: a
    source tree whose fastdecode package to import instead of this one (a baseline revision)."""
    try:
        if source is not None:
            sys.path.insert(0, source)
        e = ENGINES[engine.split("@")[0]](fmt, model, threads, max_seq_len)
    except ImportError as err:
        conn.send({"skipped": f"not installed ({err})"})
        return
    except Exception as err:  # noqa: BLE001  (any load failure is one skipped row)
        conn.send({"skipped": f"failed to load: {type(err).__name__}: {err}",
                   "traceback": traceback.format_exc()})
        return
    conn.send({"ready": True, "weight_bytes": getattr(e, "weight_bytes", None),
               "kv_bytes_per_position": getattr(e, "kv_bytes_per_position", None),
               "version": getattr(e, "version", None), "system_info": getattr(e, "system_info", None),
               "decode_path": getattr(e, "decode_path", None)})
    while (request := conn.recv()) is not None:
        try:
            conn.send(e.run(*request))
        except Exception as err:  # noqa: BLE001
            conn.send({"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()})


# ---- what each engine reads per token, and the roofline ----------------------------------------------------------
def gguf_info(model: str) -> dict:
    """Tensor bytes one llama.cpp decode step reads: every tensor, except that an untied embedding table is read one
    row at a time (a tied one is also the LM head, read whole) and a mixture-of-experts layer's stacked experts only
    for the experts a token uses; plus the GGUF's main weight type."""
    from collections import Counter

    from fastdecode.loading.catalog import resolve
    from fastdecode.loading.gguf_file import read_gguf

    g = read_gguf(resolve(model))  # shapes.py reads the same header for its file type
    total = sum(t.data.nbytes for t in g.tensors.values())
    embed = g.tensors.get("token_embd.weight")
    if embed is not None and "output.weight" in g.tensors:
        total -= embed.data.nbytes - embed.data.nbytes // embed.shape[0]
    c = g.metadata
    arch = c["general.architecture"]
    experts, used = c.get(f"{arch}.expert_count"), c.get(f"{arch}.expert_used_count")
    if experts and used:
        routed = sum(t.data.nbytes for t in g.tensors.values() if "_exps." in t.name)
        total -= routed - routed * used // experts
    heads, kv_heads = c[f"{arch}.attention.head_count"], c.get(f"{arch}.attention.head_count_kv")
    head_dim = c.get(f"{arch}.attention.key_length") or c[f"{arch}.embedding_length"] // heads
    kv = 2 * c[f"{arch}.block_count"] * (kv_heads or heads) * head_dim * 2  # llama.cpp's default f16 KV cache
    kinds = Counter(t.type.name for t in g.tensors.values() if len(t.shape) == 2 and t.name != "token_embd.weight")
    return {"weight_bytes": total, "kv_bytes_per_position": kv, "format": kinds.most_common(1)[0][0]}


def bandwidth(threads: int, sizes: list[int]) -> dict:
    """Read bandwidth (GB/s) at DRAM and at each working set: a small model's weights sit partly in L3, so each
    row's roofline uses the bandwidth at its own bytes per token. The fastest of the probe's reads, not the median:
    a ceiling should not inherit a moment when another process held a core."""
    try:
        from fastdecode.roofline.probe import measure_bandwidth
        source = "fastdecode.roofline.probe.measure_bandwidth"
    except ImportError:
        measure_bandwidth, source = local_bandwidth, "bench/decode.py local_bandwidth (probe not importable)"
    result = {"source": source, "working_sets": {}}
    for i, size in enumerate(sorted({probe_size(s) for s in sizes})):
        m = measure_bandwidth(threads=threads, size_bytes=size) if i == 0 else \
            measure_bandwidth(threads=threads, size_bytes=size, large_bytes=size)
        if i == 0:
            result["dram_gb_s"] = m.get("large", {}).get("max", m["bandwidth_gb_s"])
        result["working_sets"][size] = m.get("working_set", {}).get("max", m["working_set_gb_s"])
    return result


def probe_size(bytes_per_token: int) -> int:
    """Working sets within 10 MB of each other share one bandwidth probe."""
    return max(10**7, int(round(bytes_per_token, -7)))


def local_bandwidth(threads, size_bytes, large_bytes=1 << 30, repeats=9):
    """Fallback probe, shaped like measure_bandwidth's answer: x.sum() on float32 tensors after one warm-up read."""
    import statistics

    import torch

    torch.set_num_threads(threads)

    def read(size):
        x = torch.ones(size // 4)
        x.sum()
        samples = []
        for _ in range(repeats):
            t = time.perf_counter()
            x.sum()
            samples.append(x.nbytes / (time.perf_counter() - t) / 1e9)
        return {"gb_s": statistics.median(samples), "max": max(samples)}

    large, working = read(large_bytes), read(size_bytes)
    return {"bandwidth_gb_s": large["gb_s"], "working_set_gb_s": working["gb_s"], "large": large,
            "working_set": working}


# ---- the run -----------------------------------------------------------------------------------------------------
def prompt_ids(model: str, context: int = 0):
    """(tokenizer, prompt ids) from our chat template and tokenizer, and whether transformers' own template and
    tokenizer give the same ids (None where it cannot tell). `context`: earlier versions of the module go before the
    request until the prompt has at least that many tokens (decode speed at an agent's context length)."""
    from fastdecode.loading import load_tokenizer
    from fastdecode.loading.catalog import resolve

    path = resolve(model)
    tok = load_tokenizer(path)
    content = PROMPT
    while True:
        messages = [{"role": "user", "content": content}]
        ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True), add_special_tokens=False)
        if len(ids) >= context:
            break
        content = f"An earlier version of the module:\n\n```python\n{CODE}```\n\n{content}"
    try:
        from transformers import AutoTokenizer
        hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        hf_ids = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        hf_ids = hf_ids["input_ids"] if isinstance(hf_ids, dict) or hasattr(hf_ids, "keys") else hf_ids
        return tok, ids, list(hf_ids) == ids
    except Exception:  # noqa: BLE001  (transformers missing or unable: the check is informational)
        return tok, ids, None


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=MODEL)
    p.add_argument("--runs", type=int, default=3, help="timed runs per engine (after one warm-up)")
    p.add_argument("--tokens", type=int, default=256, help="output tokens per run")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--formats", default=",".join(FORMATS), help=f"fastdecode formats, from {','.join(FORMATS)}")
    p.add_argument("--peers", default=",".join(PEERS), help="peer engines, or '' for none")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    p.add_argument("--quick", action="store_true", help="smoke run: 1 run of 32 tokens, written as decode-quick.*")
    p.add_argument("--context", type=int, default=0, help="make the prompt at least this many tokens long (earlier "
                                                              "versions of the module before the request)")
    p.add_argument("--baseline", metavar="REV", help="also time fastdecode as of this git revision (e.g. HEAD~1) in "
                                                      "every format, interleaved with this tree's runs")
    args = p.parse_args(argv)
    if args.quick:
        args.runs, args.tokens = 1, 32
    formats = [f for f in args.formats.split(",") if f]
    bad = [f for f in formats if f not in FORMATS]
    if bad:
        p.error(f"unknown format(s) {bad}; known: {FORMATS}")
    peers = [e for e in args.peers.split(",") if e]
    if [e for e in peers if e not in PEERS]:
        p.error(f"unknown peer(s) in {peers}; known: {PEERS}")
    specs = [("fastdecode", f) for f in formats]
    sources = {}
    if args.baseline:
        name = f"fastdecode@{short_sha(args.baseline)}"
        specs += [(name, f) for f in formats]
        sources = {spec: str(package_at(args.baseline)) for spec in specs if spec[0] == name}
    specs += [("transformers", f) for f in ("fp32", "bf16") if "transformers" in peers]
    specs += [("llama.cpp", "gguf")] if "llama.cpp" in peers else []

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 160)  # a log file gets the whole table
    host = machine()  # now: the load average at the start says how busy the machine was
    tok, ids, same_ids = prompt_ids(args.model, args.context)
    max_seq_len = max(4096, len(ids) + args.tokens + 64)
    rows = {spec: {"engine": spec[0], "format": spec[1], "runs": []} for spec in specs}
    gguf = gguf_info(args.model)
    rows.get(("llama.cpp", "gguf"), {})["format"] = gguf["format"]
    ctx = mp.get_context("spawn")
    workers = {}
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        loading = progress.add_task("loading", total=len(specs))
        for spec in specs:
            progress.update(loading, description=f"loading {spec[0]} {spec[1]}")
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=worker, args=(child, *spec, args.model, args.threads, max_seq_len,
                                                    sources.get(spec)), daemon=True)
            proc.start()
            msg = receive(parent, proc)
            if msg.get("ready"):
                workers[spec] = (proc, parent)
                rows[spec].update({k: v for k, v in msg.items() if k != "ready" and v is not None})
            else:
                rows[spec].update(skipped=msg.get("skipped") or msg.get("error"), traceback=msg.get("traceback"))
                console.print(f"[yellow]skipping {spec[0]} {spec[1]}: {rows[spec]['skipped']}")
            progress.advance(loading)
        sizes = {spec: bytes_per_token(rows[spec], gguf, len(ids), args.tokens) for spec in workers}
        probe = progress.add_task("bandwidth", total=None)
        bw_before = bandwidth(args.threads, list(sizes.values()))
        progress.remove_task(probe)
        rounds = [("warm-up", min(args.tokens, 32))] + [(f"run {i + 1}", args.tokens) for i in range(args.runs)]
        total = len(rounds) * len(workers)
        timing = progress.add_task("timing", total=total)
        for done, (name, tokens) in enumerate(rounds, 1):  # A B C A B C ...: every engine once per round
            for spec, (proc, conn) in list(workers.items()):
                progress.update(timing, description=f"{name}: {spec[0]} {spec[1]}")
                conn.send((ids, tokens))
                result = receive(conn, proc)
                progress.advance(timing)
                if "error" in result:
                    rows[spec].update(skipped=f"failed during {name}: {result['error']}",
                                      traceback=result.get("traceback"))
                    console.print(f"[red]{spec[0]} {spec[1]} failed during {name}: {result['error']}")
                    workers.pop(spec)
                    proc.kill()
                    total -= len(rounds) - done
                    progress.update(timing, total=total)
                elif name != "warm-up":
                    rows[spec]["runs"].append(result)
        for proc, conn in workers.values():
            conn.send(None)
            proc.join(timeout=10)
        probe = progress.add_task("bandwidth", total=None)
        bw_after = bandwidth(args.threads, list(sizes.values()))
        progress.remove_task(probe)
    report = summarize(args, host, rows, sizes, (bw_before, bw_after), ids, same_ids, tok.decode)
    stem = "decode-quick" if args.quick else "decode"
    write_json(args.out / f"{stem}.json", report)
    md = render(report, console, Table)
    (args.out / f"{stem}.md").write_text(md + "\n")
    console.print(f"wrote {args.out / (stem + '.json')} and {args.out / (stem + '.md')}")


def receive(conn, proc) -> dict:
    """The worker's next message, or an error if it died (a segfault in a native library, say)."""
    while not conn.poll(0.5):
        if not proc.is_alive():
            return {"error": f"worker died (exit code {proc.exitcode})"}
    try:
        return conn.recv()
    except EOFError:
        proc.join(timeout=5)
        return {"error": f"worker died (exit code {proc.exitcode})"}


def bytes_per_token(row: dict, gguf: dict, prompt_tokens: int, tokens: int) -> int:
    """Weights plus KV cache read by one decode step at the mean context of the timed decode (prompt + tokens / 2)."""
    src = gguf if row["engine"] == "llama.cpp" else row
    return int(src["weight_bytes"] + src["kv_bytes_per_position"] * (prompt_tokens + tokens / 2))


def summarize(args, host, rows, sizes, probes, ids, same_ids, decode) -> dict:
    ref = rows.get(REFERENCE)
    ref_tokens = ref["runs"][0]["tokens"] if ref and ref.get("runs") else None
    out = []
    for spec, row in rows.items():
        r = {"engine": row["engine"], "format": row["format"]}
        if row.get("skipped") or not row["runs"]:
            r["skipped"] = row.get("skipped") or "no timed run"
            if row.get("traceback"):
                r["traceback"] = row["traceback"]
            out.append(r)
            continue
        runs = row["runs"]
        gb_s = max(p["working_sets"][probe_size(sizes[spec])] for p in probes)
        r.update(decode_tok_s=stats([x["decode_tok_s"] for x in runs]),
                 prefill_tok_s=stats([x["prefill_tok_s"] for x in runs]), ttft_s=stats([x["ttft_s"] for x in runs]),
                 bytes_per_token=sizes[spec], bandwidth_gb_s=gb_s, roofline_tok_s=gb_s * 1e9 / sizes[spec])
        r["roofline_pct"] = 100 * r["decode_tok_s"]["median"] / r["roofline_tok_s"]
        tokens = runs[0]["tokens"]
        r["tokens_stable_across_runs"] = all(x["tokens"] == tokens for x in runs)
        r["text"] = decode(tokens)  # a fast engine that decodes garbage shows here
        if ref_tokens is not None:
            same = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b), min(len(tokens),
                                                                                           len(ref_tokens)))
            r["greedy_match"] = {"reference": "transformers fp32", "same_leading_tokens": same, "of": len(ref_tokens),
                                 "identical": tokens == ref_tokens}
        if "own_decode_tok_s" in runs[0]:
            r["llama_cpp_own_timings"] = {"decode_tok_s": stats([x["own_decode_tok_s"] for x in runs]),
                                          "prefill_tok_s": stats([x["own_prefill_tok_s"] for x in runs])}
        for key in ("decode_path", "version", "system_info"):
            if key in row:
                r[key] = row[key]
        out.append(r)
    timed = [r for r in out if "skipped" not in r]
    llama = next((r for r in timed if r["engine"] == "llama.cpp"), None)
    hf = max((r for r in timed if r["engine"] == "transformers"), key=lambda r: r["decode_tok_s"]["median"],
             default=None)
    peers = [r for r in timed if not r["engine"].startswith("fastdecode")]
    base = {r["format"]: r for r in timed if r["engine"].startswith("fastdecode@")}
    best_prefill = max((r["prefill_tok_s"]["median"] for r in peers), default=None)
    for r in timed:
        d = r["decode_tok_s"]["median"]
        r["vs_llama_cpp"] = d / llama["decode_tok_s"]["median"] if llama else None
        r["vs_transformers"] = d / hf["decode_tok_s"]["median"] if hf else None
        r["prefill_vs_best_peer"] = r["prefill_tok_s"]["median"] / best_prefill if best_prefill else None
        if r["engine"] == "fastdecode" and r["format"] in base:
            b = base[r["format"]]
            r["vs_baseline"] = {"baseline": b["engine"], "decode": d / b["decode_tok_s"]["median"],
                                "prefill": r["prefill_tok_s"]["median"] / b["prefill_tok_s"]["median"]}
    return {"model": args.model, "threads": args.threads, "tokens": args.tokens, "runs": args.runs,
            "bandwidth_gb_s": max((p["dram_gb_s"] for p in probes if "dram_gb_s" in p), default=None),
            "bandwidth": {"source": probes[0]["source"], "before": probes[0], "after": probes[1],
                          "note": "each row's roofline uses the bandwidth read at its own bytes per token"},
            "machine": host, "command": command_line(), "commit": short_sha("HEAD"),
            "prompt": {"tokens": len(ids), "mean_decode_context": len(ids) + args.tokens / 2,
                       "transformers_tokenizer_agrees": same_ids, "text": PROMPT},
            "vs_transformers_is": f"transformers {hf['format']}" if hf else None, "rows": out}


HEADERS = ["engine", "format", "output tok/s", "prefill tok/s", "MB/token", "roofline tok/s", "% roofline",
           "x llama.cpp", "x transformers", "greedy = HF fp32"]


def render(report: dict, console, Table) -> str:
    """Prints the table with rich; returns it as markdown, with the notes a reader needs to trust it."""
    cells = []
    for r in report["rows"]:
        if "skipped" in r:
            cells.append([r["engine"], r["format"], "skipped"] + [""] * 7)
            continue
        m = r.get("greedy_match")
        match = "-" if not m else ("yes" if m["identical"] else f"first {m['same_leading_tokens']}/{m['of']}")
        form = r["format"] + (f" ({r['decode_path']})" if "decode_path" in r else "")
        cells.append([r["engine"], form, fmt_range(r["decode_tok_s"]), fmt_range(r["prefill_tok_s"], ".0f"),
                      fmt(r["bytes_per_token"] / 1e6), fmt(r["roofline_tok_s"], ".0f"), fmt(r["roofline_pct"], ".0f"),
                      fmt(r["vs_llama_cpp"], ".2f"), fmt(r["vs_transformers"], ".2f"), match])
    table = Table(title=f"{report['model']}: greedy decode of {report['tokens']} tokens, {report['threads']} threads")
    for h in HEADERS:
        table.add_column(h, justify="left" if h in ("engine", "format") else "right", no_wrap=True)
    for row in cells:
        table.add_row(*row)
    console.print(table)
    m, pr, bw = report["machine"], report["prompt"], report["bandwidth"]
    best = {s: max(g, bw["after"]["working_sets"][s]) for s, g in bw["before"]["working_sets"].items()}
    sets = ", ".join(f"{s / 1e6:.0f} MB: {g:.1f}" for s, g in sorted(best.items()))
    notes = [
        f"{m['cpu']}, {m['cores']} cores ({', '.join(m['isa'])}), torch {m['torch']}, {m['date']}; "
        f"load average {m['load_avg_1m_at_start']:.1f} at start. Command: `{report['command']}`.",
        f"Median (min-max) of {report['runs']} timed run(s) after one warm-up, engines interleaved run by run. "
        f"Output tok/s is decode only (the first token belongs to TTFT).",
        f"Prompt: {pr['tokens']} tokens (a code-editing request through the chat template; the same token ids for "
        f"every engine); bytes per token include the KV cache at the mean decode context ({pr['mean_decode_context']:.0f}).",
        f"Bandwidth (GB/s, the fastest read of the probes before and after the runs): DRAM "
        f"{fmt(report['bandwidth_gb_s'])}; at each row's working set: {sets}. Roofline = that bandwidth / bytes per "
        f"token.",
        f"x transformers compares with {report['vs_transformers_is']}; greedy = HF fp32 compares each row's tokens "
        f"with transformers float32 on the same GGUF. fastdecode's decode path is in brackets: native (the C++ "
        f"whole-model step) or pytorch.",
    ]
    notes += [f"{r['format']}: {r['vs_baseline']['decode']:.2f}x the decode and {r['vs_baseline']['prefill']:.2f}x the "
              f"prefill speed of {r['vs_baseline']['baseline']}" for r in report["rows"] if "vs_baseline" in r]
    notes += [f"{r['engine']} {r['format']} skipped: {r['skipped'].splitlines()[0]}" for r in report["rows"]
              if "skipped" in r]
    console.print("\n".join(notes))
    return markdown_table(HEADERS, cells) + "\n\n" + "\n".join(f"- {n}" for n in notes)


if __name__ == "__main__":
    main()
