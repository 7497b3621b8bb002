"""What a grammar costs a decode step at batch 8, on SmolLM2 (49k vocabulary) and Gemma 3 (262k).

Two measurements per model:
    rows      per row, checking the token the model picked (a step pays this when the grammar allows it) and
              masking the vocabulary (when it refuses it), over a tool call's JSON under its schema and over free
              text under an `auto` tool grammar (whose text may never open a call)
    decode    8 greedy requests decoded together by the engine, with no grammar, and with a grammar that allows
              everything (so the tokens are the same and the difference is the grammar's cost): "grammar" checks
              the picked token and masks only on refusal (what the server does), "full mask" masks every row (what
              masking first would cost); runs interleaved, median of --runs

    python bench/grammar_overhead.py                 # both models, 3 runs
    python bench/grammar_overhead.py --models smollm2-135m --runs 5

Writes bench/results/grammar_overhead.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import command_line, fmt_range, machine, markdown_table, stats, write_json  # noqa: E402

from fastdecode import LLM, SamplingParams  # noqa: E402
from fastdecode.engine.grammar import GrammarCompiler, GrammarProcessor, json_schema_grammar, lark_grammar  # noqa
from fastdecode.loading.catalog import cached_path  # noqa: E402
from fastdecode.server.formats import HermesParser  # noqa: E402
from fastdecode.server.formats.lark import vocabulary_tokens  # noqa: E402

BATCH = 8
WAYS = ("none", "grammar", "full mask")
TEXT = ("I looked at the server code. The request handler returns None when the body is empty, which the client "
        "reads as a failure. I will change it to return an empty response instead, then run the tests again.")
SCHEMA = {"type": "object", "properties": {
    "path": {"type": "string"}, "old_string": {"type": "string"}, "new_string": {"type": "string"},
    "replace_all": {"type": "boolean"}, "lines": {"type": "array", "items": {"type": "integer", "minimum": 1}}},
    "required": ["path", "old_string", "new_string"], "additionalProperties": False}
DOCUMENT = {"path": "src/server/app.py", "old_string": "def answer(request):\n    return None",
            "new_string": "def answer(request):\n    return handle(request)", "replace_all": False,
            "lines": [12, 13, 140]}
PROMPTS = ["Write a long story about a lighthouse keeper.", "Explain how a compiler works, step by step.",
           "Describe the water cycle in detail.", "List the planets and say something about each.",
           "Write a letter to a friend about a trip to Norway.", "Explain recursion to a child.",
           "Describe how to bake bread.", "Tell the history of the bicycle."]


def row_costs(compiler: GrammarCompiler, grammar: str, text: str) -> dict:
    """Per row, over `text`'s tokens under `grammar`: checking the token the model picked (what a step pays when the
    grammar allows it), and masking the vocabulary (what it pays when the grammar refuses it, and what sampled
    speculative verification pays)."""
    ids = compiler.tokenizer.encode(text, add_special_tokens=False)
    eos = compiler.tokenizer.eos_token_ids
    check, mask = [], []
    for _ in range(3):
        p = GrammarProcessor(compiler.matcher(grammar), compiler.vocab_size, eos)
        logits = torch.randn(compiler.vocab_size)
        for k in range(len(ids)):
            t0 = time.perf_counter()
            assert p.accepts(ids[:k], ids[k])
            t1 = time.perf_counter()
            p(ids[:k], logits)
            t2 = time.perf_counter()
            check.append(t1 - t0)
            mask.append(t2 - t1)
    return {"tokens": len(ids), "check_us": stats([x * 1e6 for x in check]), "mask_us": stats([x * 1e6 for x in mask])}


def decode(llm: LLM, compiler: GrammarCompiler, way: str, max_tokens: int) -> tuple[float, list[list[int]]]:
    """8 greedy requests together -> (seconds, their tokens)."""
    anything = lark_grammar("start: /(?s:.*)/")
    eos = llm.tokenizer.eos_token_ids

    def made():
        p = GrammarProcessor(compiler.matcher(anything), compiler.vocab_size, eos)
        return p if way == "grammar" else lambda output_ids, logits: p(output_ids, logits)  # no check: every mask
    processors = [None if way == "none" else made() for _ in PROMPTS]
    prompts = [llm.chat_prompt([{"role": "user", "content": p}]) for p in PROMPTS]
    for p in prompts:  # prefill outside the timing: one token each, so the cached prompt is all decode needs
        llm._last(llm.stream(p, SamplingParams(max_tokens=1)))
    t0 = time.perf_counter()
    streams = [llm.stream(p, SamplingParams(max_tokens=max_tokens), proc) for p, proc in zip(prompts, processors)]
    outputs = [llm._last(s).token_ids for s in streams]
    return time.perf_counter() - t0, outputs


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="smollm2-135m,gemma3-270m")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="bench/results/grammar_overhead")
    a = parser.parse_args()
    results = []
    for name in a.models.split(","):
        llm = LLM(str(cached_path(name)), threads=a.threads, max_seq_len=1024, kv_disk_gb=0)
        compiler = GrammarCompiler(llm.tokenizer)
        rows = {"JSON under a schema": row_costs(compiler, json_schema_grammar(SCHEMA), json.dumps(DOCUMENT)),
                "text under a tool grammar (auto)": row_costs(compiler, lark_grammar(HermesParser.call_grammar(
                    {"edit": SCHEMA}, forced=False, added_tokens=vocabulary_tokens(llm.tokenizer))), TEXT)}
        runs = {way: [] for way in WAYS}
        tokens = {}
        decode(llm, compiler, "none", 8)  # warm-up
        for _ in range(a.runs):
            for way in runs:
                seconds, out = decode(llm, compiler, way, a.max_tokens)
                runs[way].append(seconds / sum(map(len, out)) * BATCH * 1e3)  # ms per step of 8 rows
                tokens.setdefault(way, out)
        same = all(tokens[w] == tokens["none"] for w in WAYS)
        step = {way: stats(r) for way, r in runs.items()}
        results.append({"model": name, "vocab": compiler.vocab_size, "rows": rows, "step_ms": step,
                        "same_tokens": same})
        print(name, json.dumps({k: round(v["median"], 2) for k, v in step.items()}), "same tokens:", same,
              json.dumps({k: [round(v["check_us"]["median"], 1), round(v["mask_us"]["median"], 1)]
                          for k, v in rows.items()}))
        llm.close()
    data = {"command": command_line(), "machine": machine(), "batch": BATCH, "runs": a.runs, "results": results}
    write_json(Path(a.out + ".json"), data)
    lines = []
    for r in results:
        for kind, c in r["rows"].items():
            lines.append([r["model"], f"{r['vocab']:,}", kind, fmt_range(c["check_us"]), fmt_range(c["mask_us"])])
    rows_table = markdown_table(["model", "vocabulary", "state", "check the picked token, µs", "mask, µs"], lines)
    lines = []
    for r in results:
        none = r["step_ms"]["none"]["median"]
        extra = [(r["step_ms"][w]["median"] - none) / BATCH * 1e3 for w in WAYS[1:]]
        lines.append([r["model"], *(fmt_range(r["step_ms"][w], ".2f") for w in WAYS),
                      " / ".join(f"{x:+.0f}" for x in extra), "yes" if r["same_tokens"] else "NO"])
    table = markdown_table(["model", "step ms, no grammar", "step ms, grammar (check, mask on refusal)",
                            "step ms, grammar (mask every row)", "µs per row vs none", "same tokens"], lines)
    m = data["machine"]
    Path(a.out + ".md").write_text(
        f"# Grammar overhead at batch {BATCH}\n\n`{data['command']}`\n\n{m['cpu']}, {m['cores']} cores, "
        f"{m['date']}. Step times: median (min-max) of {a.runs} interleaved runs of {BATCH} greedy requests of "
        f"{a.max_tokens} tokens, under a grammar that allows everything (so the tokens are the same).\n\n{table}\n\n"
        f"Per row, median (min-max) over a document's tokens, 3 passes:\n\n{rows_table}\n")
    print(table)


if __name__ == "__main__":
    main()
