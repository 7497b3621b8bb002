"""What the suffix drafter's lookup costs the engine thread at an agent's context lengths: SuffixDrafter.propose with
a gate that lets nothing through (what a step pays on text where drafts fail) and the request index's match alone,
microseconds a step, over the next 200 tokens of Python source after each context (the standard library's files,
tokenized with SmolLM2's tokenizer).

    python bench/draft_lookup.py                                  # bench/results/draft_lookup.{json,md}
    python bench/draft_lookup.py --baseline 4a54143 --rounds 5    # beside fastdecode at that revision, rounds alternating

With --baseline the revision's package runs in a child process (`package_at`), rounds alternating with today's.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from common import command_line, fmt_range, machine, markdown_table, package_at, stats, write_json

STEPS = 200


def measure(contexts: list[int]) -> dict:
    """{context: (propose us, match us)} for this process's fastdecode."""
    import sysconfig

    from fastdecode.loading import load_tokenizer
    from fastdecode.loading.catalog import resolve
    from fastdecode.speculative.suffix import SuffixDrafter

    tok = load_tokenizer(resolve("smollm2-135m"))
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    ids: list[int] = []
    for f in files:
        if len(ids) > max(contexts) + STEPS:
            break
        ids += tok.encode(f.read_text(errors="replace"), add_special_tokens=False)
    out = {}
    for n in contexts:
        steps = [ids[:n + i] for i in range(STEPS)]
        d = SuffixDrafter()
        d.start(steps[0])
        t0 = time.perf_counter()
        for c in steps:
            d.propose(c, 8, lambda score: False)
        propose = (time.perf_counter() - t0) / STEPS * 1e6
        t0 = time.perf_counter()
        for c in steps:
            d.local.match(c, d.max_match)
        out[n] = (propose, (time.perf_counter() - t0) / STEPS * 1e6)
    return out


def child(rev: str, contexts: list[int]) -> dict:
    code = (f"import sys; sys.path[:0] = [{str(package_at(rev))!r}, {str(Path(__file__).parent)!r}]; "
            f"import json, draft_lookup; print(json.dumps(draft_lookup.measure({contexts!r})))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return {int(k): v for k, v in json.loads(run.stdout.strip().splitlines()[-1]).items()}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", default="1000,5000,20000", help="context lengths in tokens")
    p.add_argument("--baseline", default="", help="a git revision to time beside")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = p.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    sides = ["current"] + ([args.baseline] if args.baseline else [])
    runs: dict = {(s, n): ([], []) for s in sides for n in contexts}
    for r in range(args.rounds):
        for side in sides if r % 2 == 0 else sides[::-1]:
            got = measure(contexts) if side == "current" else child(side, contexts)
            for n, (propose, match) in got.items():
                runs[side, n][0].append(propose)
                runs[side, n][1].append(match)
    rows = [{"side": s, "context": n, "propose_us": stats(runs[s, n][0]), "match_us": stats(runs[s, n][1])}
            for s in sides for n in contexts]
    report = {"machine": machine(), "command": command_line(), "steps": STEPS, "rounds": args.rounds, "rows": rows}
    write_json(args.out / "draft_lookup.json", report)
    table = markdown_table(["fastdecode", "context", "propose, gate closed (us a step)", "match (us a step)"],
                           [[r["side"], str(r["context"]), fmt_range(r["propose_us"]), fmt_range(r["match_us"])]
                            for r in rows])
    md = (f"# The suffix drafter's lookup by context length\n\n`{report['command']}` on {report['machine']['cpu']}, "
          f"median (min-max) of {args.rounds} rounds of {STEPS} steps.\n\n{table}\n")
    (args.out / "draft_lookup.md").write_text(md)
    print(md)
    print(f"wrote {args.out / 'draft_lookup.json'} and {args.out / 'draft_lookup.md'}")


if __name__ == "__main__":
    main()
