"""Speculative decoding benchmark: plain decode, each drafter and `auto`, per coding-agent workload category, beside
llama.cpp's and transformers' prompt lookup, on the same prompts, in one run.

    python bench/speculative.py                 # 3 prompts per category, up to 128 tokens; bench/results/speculative.*
    python bench/speculative.py --quick         # 1 prompt per category, 32 tokens; speculative-quick.*
    python bench/speculative.py --configs none,auto,none@ba4a3e5,auto@ba4a3e5 --peers '' --categories code_edit \
        --per-category 9 --out bench/results/kernels-ab   # beside fastdecode as it was at another revision
    python bench/speculative.py --configs none,auto --peers '' --repeats 5   # median (min-max) over 5 whole runs
    python bench/speculative.py --model ~/.cache/fastdecode/shapes/gpt-oss-20b-MXFP4.gguf --quant gguf \
        --configs none,auto --peers '' --one-at-a-time --repeats 3   # a 12 GB model, one worker at a time

`eagle` and `auto+eagle` use the trained head `make drafter` writes (docs/eagle.md); without it those rows are
skipped.

Every engine gets the same token ids (our chat template). Greedy decoding everywhere, except that the low-overlap
category applies a repetition penalty of 1.15 in every engine (Hugging Face's rule over prompt and output; llama.cpp
with its penalty window set to the whole context): a 135M model decoding greedily falls into loops, which would
flatter every drafter. The `repeat share` column checks it: the share of output 4-grams already seen in the prompt
or earlier output. Each engine runs in its own worker process; the prompts run round-robin across engines (A B C A
B C) so drift on a shared machine falls on all of them. Per category: mean output tok/s (first token excluded),
floor (the speed lab's window floor, lab/metrics.py: each generation's slowest 32-token stretch, then the 5th
percentile of those), mean accepted draft tokens per verify step, speedup
over our plain decode; per engine, whether its greedy tokens equal its own plain decode.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
import traceback
from pathlib import Path

from common import command_line, fmt, fmt_range, machine, markdown_table, stats, write_json

MODEL = "smollm2-135m"
OURS = ["none", "ngram", "suffix", "layerskip", "auto"]
# The trained head (`make drafter`, docs/eagle.md) alone and beside auto's drafters; skipped rows without a head.
HEADS = ["eagle", "auto+eagle"]
PEERS = ["llama.cpp", "llama.cpp+lookup", "transformers", "transformers+lookup"]
LOW_OVERLAP_PENALTY = 1.15
WINDOW = 32  # tokens in the floor's window, as the speed lab's default (lab/metrics.py WINDOW_TOKENS)
LOOKUP_TOKENS = 10  # draft length for the peers' prompt lookup (their usual setting)


# ---- engines, each in its own worker process -------------------------------------------------------------------
class Fastdecode:
    def __init__(self, config, model, threads, quant):
        config, _, rev = config.partition("@")
        if rev:  # `auto@REV`: fastdecode as it was at git revision REV, its Python and its native kernels
            import torch.utils.cpp_extension as extension

            from common import kernels_changed_since, native_kernels_at, package_at

            sys.path.insert(0, str(package_at(rev)))
            if kernels_changed_since(rev):  # (else REV's package builds today's kernels: the same sources, one build)
                ops, load = native_kernels_at(rev), extension.load
                # REV's own build would overwrite today's under the same name and directory: hand it the copy built
                # apart
                extension.load = lambda name, *a, **kw: ops if name == "fastdecode_native" else load(name, *a, **kw)
        from fastdecode import LLM

        self.llm = LLM(model, quant=quant or "none", threads=threads, speculate=config)

    def run(self, ids, max_tokens, penalty):
        from fastdecode import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, repetition_penalty=penalty, ignore_eos=True)
        times, tokens, completion = [], [], None
        start = time.perf_counter()
        for chunk in self.llm.stream(ids, params):
            if chunk.token_ids:
                now = time.perf_counter()
                times += [now] * len(chunk.token_ids)
                tokens += chunk.token_ids
            completion = chunk.completion or completion
        return {"tokens": tokens, "start": start, "times": times, "speculation": completion.speculation}


class LlamaCpp:
    def __init__(self, config, model, threads, quant):
        from llama_cpp import Llama

        from fastdecode.loading.catalog import resolve

        draft = None
        if config.endswith("+lookup"):
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
            draft = LlamaPromptLookupDecoding(num_pred_tokens=LOOKUP_TOKENS)
        # logits_all with a draft model: 0.3.36 switches it on internally but sizes its logits buffer from the
        # argument, which overflows past n_batch tokens.
        self.llm = Llama(model_path=str(resolve(model)), n_ctx=4096, n_threads=threads, n_threads_batch=threads,
                         last_n_tokens_size=4096, draft_model=draft, logits_all=draft is not None, seed=0,
                         verbose=False)

    def run(self, ids, max_tokens, penalty):
        self.llm.reset()
        tokens, times = [], []
        start = time.perf_counter()
        for token in self.llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=penalty):
            times.append(time.perf_counter())
            tokens.append(token)
            if len(tokens) == max_tokens:
                break
        return {"tokens": tokens, "start": start, "times": times}


class Transformers:
    def __init__(self, config, model, threads, quant):
        import os

        os.environ["TQDM_DISABLE"] = "1"
        import torch
        import transformers
        from transformers import AutoModelForCausalLM

        from fastdecode.loading.catalog import resolve

        torch.set_num_threads(threads)
        transformers.logging.set_verbosity_error()
        path = resolve(model)
        self.torch = torch
        self.lookup = config.endswith("+lookup")
        self.model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                          dtype=torch.float32).eval()
        self.model.generation_config.eos_token_id = None

    def run(self, ids, max_tokens, penalty):
        times = []

        class Streamer:  # put() gets the prompt, then each step's new tokens (several with prompt lookup)
            def put(self, value):
                times.append((time.perf_counter(), value.numel()))

            def end(self):
                pass

        x = self.torch.tensor([ids])
        extra = {"prompt_lookup_num_tokens": LOOKUP_TOKENS} if self.lookup else {}
        start = time.perf_counter()
        with self.torch.inference_mode():
            out = self.model.generate(x, attention_mask=self.torch.ones_like(x), max_new_tokens=max_tokens,
                                      min_new_tokens=max_tokens, do_sample=False, temperature=None, top_p=None,
                                      top_k=None, pad_token_id=0, repetition_penalty=penalty, streamer=Streamer(),
                                      **extra)
        stamps = [t for t, n in times[1:] for _ in range(n)]
        return {"tokens": out[0, len(ids):].tolist(), "start": start, "times": stamps[:max_tokens]}


def engine_for(name: str):
    if name.startswith("llama.cpp"):
        return LlamaCpp
    if name.startswith("transformers"):
        return Transformers
    return Fastdecode


def worker(conn, name, config, model, threads, quant):
    try:
        engine = engine_for(name)(config, model, threads, quant)
    except ImportError as e:
        conn.send({"skipped": f"not installed ({e})"})
        return
    except Exception as e:  # noqa: BLE001  (a load failure is one skipped row, not a failed run)
        conn.send({"skipped": f"failed to load: {type(e).__name__}: {e}", "traceback": traceback.format_exc()})
        return
    conn.send({"ready": True})
    while (request := conn.recv()) is not None:
        try:
            conn.send(engine.run(*request))
        except Exception as e:  # noqa: BLE001
            conn.send({"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})


def receive(conn, proc) -> dict:
    while not conn.poll(0.5):
        if not proc.is_alive():
            return {"error": f"worker died (exit code {proc.exitcode})"}
    return conn.recv()


# ---- metrics -------------------------------------------------------------------------------------------------------
def speed(times: list[float]) -> tuple[float | None, float | None]:
    """(output tok/s, window floor) of one generation from its tokens' arrival times, as the speed lab defines them
    (fastdecode/lab/metrics.py), so a floor here means what it means in `fastdecode bench`."""
    from fastdecode.lab.metrics import request_metrics
    from fastdecode.lab.records import Chunk, RequestRecord

    m = request_metrics(RequestRecord("", "", chunks=[Chunk(t, tokens=1) for t in times]), WINDOW)
    return (m.output_tok_s, m.window_floor_tok_s) if m else (None, None)


def repeat_share(prompt: list[int], output: list[int], n: int = 4) -> float:
    """Share of output n-grams that already occurred in the prompt or earlier in the output."""
    seen = {tuple(prompt[i:i + n]) for i in range(len(prompt) - n + 1)}
    hits = total = 0
    ctx = list(prompt)
    for t in output:
        ctx.append(t)
        if len(ctx) >= n:
            gram = tuple(ctx[-n:])
            total += 1
            hits += gram in seen
            seen.add(gram)
    return hits / total if total else 0.0


# ---- the run -----------------------------------------------------------------------------------------------------
def start_workers(engines, args, warm_up, skipped, progress, console) -> dict:
    """One worker process per engine, loaded and warmed up; engines that fail to load go to `skipped`."""
    ctx = mp.get_context("spawn")
    workers = {}
    loading = progress.add_task("loading", total=len(engines))
    for name, config in engines:
        progress.update(loading, description=f"loading {name} {config}")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=worker, args=(child, name, config, args.model, args.threads, args.quant),
                           daemon=True)
        proc.start()
        msg = receive(parent, proc)
        if msg.get("ready"):
            workers[(name, config)] = (proc, parent)
            parent.send((warm_up, 16, 1.0))  # not a timed prompt: the suffix drafter would remember it
            receive(parent, proc)
        else:
            skipped[(name, config)] = msg.get("skipped") or msg.get("error")
            console.print(f"[yellow]skipping {name} {config}: {skipped[(name, config)]}")
        progress.advance(loading)
    progress.remove_task(loading)
    return workers


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=MODEL)
    p.add_argument("--quant", default="int4", help="our weight format (int4 is our fastest; '' for float32)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--per-category", type=int, default=3, help="prompts per workload category")
    p.add_argument("--max-tokens", type=int, default=128, help="cap on each prompt's max_tokens")
    p.add_argument("--configs", default=",".join(OURS + HEADS),
                   help="our --speculate values; CONFIG@REV runs it on fastdecode as it was at git revision REV")
    p.add_argument("--categories", default="", help="comma-separated workload categories (default: all)")
    p.add_argument("--peers", default=",".join(PEERS), help="peer engines, or '' for none")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    p.add_argument("--repeats", type=int, default=1,
                   help="run everything this many times, each with fresh workers; tables show median (min-max)")
    p.add_argument("--one-at-a-time", action="store_true",
                   help="one engine loaded at a time (a model that does not fit in memory twice): each runs every "
                        "prompt in turn; --repeats alternates whole runs")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.per_category, args.max_tokens = 1, 32

    from rich.console import Console
    from rich.progress import Progress

    from fastdecode.loading import load_tokenizer
    from fastdecode.loading.catalog import resolve
    from fastdecode.workloads import CATEGORIES, load_workload

    console = Console(width=None if sys.stdout.isatty() else 200)
    host = machine()
    tok = load_tokenizer(resolve(args.model))
    items = []
    for category in args.categories.split(",") if args.categories else CATEGORIES:
        for item in load_workload(category)[:args.per_category]:
            ids = tok.encode(tok.apply_chat_template(item.messages, add_generation_prompt=True),
                             add_special_tokens=False)
            penalty = LOW_OVERLAP_PENALTY if category == "low_overlap" else 1.0
            items.append({"id": item.id, "category": category, "ids": ids,
                          "max_tokens": min(item.max_tokens, args.max_tokens), "penalty": penalty})
    warm_up = tok.encode("Hello! Which day of the week is it today?")
    engines = [("fastdecode", c) for c in args.configs.split(",") if c]
    engines += [(e, e) for e in args.peers.split(",") if e]
    results, skipped = {e: [] for e in engines}, {}
    with Progress(console=console) as progress:
        timing = progress.add_task("timing", total=args.repeats * len(items) * len(engines))
        for repeat in range(args.repeats):
            # Fresh workers every repeat: the suffix drafter remembers the earlier requests of its process, and a
            # prompt's own output from the previous repeat would flatter it.
            groups = [[e] for e in engines] if args.one_at_a_time else [engines]
            for group in groups:
                workers = start_workers([e for e in group if e not in skipped], args, warm_up, skipped, progress,
                                        console)
                for item in items:  # round-robin: every engine on this prompt, then the next prompt
                    for key, (proc, conn) in list(workers.items()):
                        progress.update(timing, description=f"run {repeat + 1}/{args.repeats} {item['id']}: {key[1]}")
                        conn.send((item["ids"], item["max_tokens"], item["penalty"]))
                        r = receive(conn, proc)
                        if "error" in r:
                            skipped[key] = r["error"]
                            console.print(f"[red]{key} failed: {r['error']}")
                            workers.pop(key)
                            proc.kill()
                        else:
                            results[key].append({**r, "item": item, "repeat": repeat})
                        progress.advance(timing)
                for proc, conn in workers.values():
                    conn.send(None)
                    proc.join(timeout=10)
    report = summarize(args, host, engines, items, results, skipped)
    stem = "speculative-quick" if args.quick else "speculative"
    write_json(args.out / f"{stem}.json", report)
    md = render(report)
    (args.out / f"{stem}.md").write_text(md + "\n")
    console.print(md)
    console.print(f"wrote {args.out / (stem + '.json')} and {args.out / (stem + '.md')}")


def summarize(args, host, engines, items, results, skipped) -> dict:
    """Per engine and category. Speeds and their ratios to plain are taken per repeat (each against the plain decode
    of the same repeat) and shown as min/median/max over repeats; draft statistics are pooled over all of them."""
    from fastdecode.lab.metrics import stats as metric_stats
    from fastdecode.workloads import CATEGORIES

    plain_of = {"fastdecode": ("fastdecode", "none"), "llama.cpp": ("llama.cpp", "llama.cpp"),
                "transformers": ("transformers", "transformers")}
    ours_plain = ("fastdecode", "none")

    def speeds(runs) -> dict:
        """repeat -> (mean tok/s, floor) of that repeat's runs."""
        by_repeat = {}
        for r in runs:
            by_repeat.setdefault(r["repeat"], []).append(r)
        out = {}
        for repeat, group in by_repeat.items():
            measured = [speed(r["times"]) for r in group]
            tok_s = [s for s, _ in measured if s is not None]
            floor = metric_stats(f for _, f in measured)  # the lab's floor: P5 of the window floors
            out[repeat] = (statistics.mean(tok_s) if tok_s else None, floor.p5 if floor else None)
        return out

    def ratios(values: dict, bases: dict, i: int) -> dict:
        return stats([v[i] / bases[k][i] for k, v in values.items() if k in bases and v[i] and bases[k][i]])

    base = {category: speeds([r for r in results.get(ours_plain, []) if r["item"]["category"] == category])
            for category in CATEGORIES}
    rows = []
    for key in engines:
        name, config = key
        if key in skipped and not results[key]:
            rows.append({"engine": name, "config": config, "skipped": skipped[key]})
            continue
        plain = {(r["item"]["id"], r["repeat"]): r for r in results.get(plain_of[name.split("+")[0]], [])}
        per_category = {}
        for category in CATEGORIES:
            runs = [r for r in results[key] if r["item"]["category"] == category]
            if not runs:
                continue
            measured = speeds(runs)
            spec = [r["speculation"] for r in runs if r.get("speculation")]
            same = [r["tokens"] == plain[k]["tokens"] for r in runs if (k := (r["item"]["id"], r["repeat"])) in plain]
            per_category[category] = {
                "prompts": len({r["item"]["id"] for r in runs}), "repeats": len(measured),
                "mean_tok_s": stats([v[0] for v in measured.values() if v[0]]),
                "floor_tok_s": stats([v[1] for v in measured.values() if v[1]]),
                "speedup_mean": ratios(measured, base[category], 0),
                "speedup_floor": ratios(measured, base[category], 1),
                "repeat_share": statistics.mean(repeat_share(r["item"]["ids"], r["tokens"]) for r in runs),
                "mean_accepted_length": (sum(s["accepted"] for s in spec) / max(1, sum(s["verify_steps"]
                                                                                     for s in spec))) if spec else None,
                "acceptance_rate": (sum(s["accepted"] for s in spec) / max(1, sum(s["drafted"] for s in spec)))
                if spec else None,
                "tokens_per_forward": (sum(s["accepted"] + s["steps"] for s in spec) / max(1, sum(s["steps"]
                                                                                               for s in spec)))
                if spec else None,
                "identical_to_own_plain": f"{sum(same)}/{len(same)}" if same else None,
            }
        rows.append({"engine": name, "config": config, "categories": per_category})
    return {"model": args.model, "quant": args.quant, "threads": args.threads, "per_category": args.per_category,
            "repeats": args.repeats, "max_tokens": args.max_tokens,
            "low_overlap_repetition_penalty": LOW_OVERLAP_PENALTY, "floor_window_tokens": WINDOW,
            "peer_lookup_tokens": LOOKUP_TOKENS, "machine": host, "command": command_line(), "rows": rows}


def render(report: dict) -> str:
    headers = ["engine", "config", "category", "mean tok/s", "floor tok/s", "x plain (mean)", "x plain (floor)",
               "accepted/verify", "tokens/forward", "repeat share", "= own plain"]
    cells = []
    for r in report["rows"]:
        if "skipped" in r:
            cells.append([r["engine"], r["config"], "-", "skipped: " + r["skipped"][:60]] + ["-"] * 7)
            continue
        for category, c in r["categories"].items():
            cells.append([r["engine"], r["config"], category, fmt_range(c["mean_tok_s"]), fmt_range(c["floor_tok_s"]),
                          fmt_range(c["speedup_mean"], ".2f"), fmt_range(c["speedup_floor"], ".2f"),
                          fmt(c["mean_accepted_length"], ".2f"), fmt(c["tokens_per_forward"], ".2f"),
                          fmt(c["repeat_share"], ".2f"), c["identical_to_own_plain"] or "-"])
    m = report["machine"]
    repeats = report.get("repeats", 1)
    runs = (f"everything run {repeats} times, each time with fresh workers; speeds and ratios are median (min-max) "
            "over those runs, each ratio taken within its run; " if repeats > 1 else "")
    notes = [f"# Speculative decoding: {report['model']} ({report['quant'] or 'float32'}), {report['threads']} threads",
             "", f"`{report['command']}` on {m['cpu']} ({m['cores']} cores), {m['date']}, load average at start "
             f"{m['load_avg_1m_at_start']}.", "",
             f"{report['per_category']} prompts per category, up to {report['max_tokens']} tokens each, greedy; "
             f"{runs}"
             f"low_overlap with repetition penalty {report['low_overlap_repetition_penalty']} in every engine. "
             f"Floor: as the speed lab's (lab/metrics.py): each generation's slowest "
             f"{report['floor_window_tokens']}-token stretch, then the 5th percentile over generations. "
             "`x plain`: against fastdecode's plain decode (`none`) in the same run. Peers' prompt lookup drafts "
             f"{report['peer_lookup_tokens']} tokens.", ""]
    return "\n".join(notes) + markdown_table(headers, cells)


if __name__ == "__main__":
    main()
