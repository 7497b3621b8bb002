"""One user streams while another pastes a long prompt: how long does the streaming user wait for its next token?

With chunked prefill the long prompt is computed a chunk per engine step between the streaming user's decode steps,
so the stream's longest gap is about one chunk's time (the scheduler sizes chunks to about 0.3 s while anyone
decodes), not the whole prefill. Reports the streaming user's median and longest gap between tokens before and
during the other prompt's prefill, and the long prompt's TTFT, through `fastdecode serve`.

    python bench/prefill_gap.py                       # SmolLM2-135M, a 4k-token paste
"""
from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.agent_session import ROOT, Server  # noqa: E402
from bench.common import command_line, git_state, machine, write_json  # noqa: E402


def long_prompt(tokens: int) -> str:
    files = sorted((ROOT / "fastdecode").rglob("*.py"))
    text = ""
    for f in files:
        text += f.read_text()
        if len(text) > tokens * 3.2:
            break
    return "Review this code:\n" + text[:int(tokens * 3.2)]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--paste-tokens", type=int, default=4000)
    p.add_argument("--stream-tokens", type=int, default=2000, help="enough to outlast the paste's prefill")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--serve-args", default="--speculate none")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "prefill_gap"))
    a = p.parse_args()

    server = Server("fastdecode", a.model, a.serve_args.split() + ["--threads", str(a.threads),
                                                                     "--max-seq-len", "8192"])
    try:
        user = [{"role": "user", "content": "Count from 1 to 1000, one number per line."}]
        paste = [{"role": "user", "content": long_prompt(a.paste_tokens)}]
        server.stream(user, 8)  # warm-up
        result = {}
        t0 = time.perf_counter()

        def streamer():
            result["stream"] = server.stream(user, a.stream_tokens, ignore_eos=True)

        thread = threading.Thread(target=streamer)
        thread.start()
        time.sleep(3.0)  # let it stream a while first
        sent = time.perf_counter() - t0
        pasted = server.stream(paste, 8)
        paste_done = sent + pasted["times"][0]
        thread.join()
    finally:
        server.close()
    times = result["stream"]["times"]
    if times[-1] < paste_done:
        sys.exit("error: the stream ended before the paste's first token; raise --stream-tokens")
    gaps = [(b, b - a) for a, b in zip(times, times[1:])]
    before = [g for t, g in gaps if t < sent]
    during = [g for t, g in gaps if sent <= t <= paste_done + 0.5]
    out = {"benchmark": "prefill_gap", **git_state(), "command": command_line(), "machine": machine(),
           "server": server.command, "paste_prompt_tokens": pasted["usage"].get("prompt_tokens"),
           "paste_ttft_s": pasted["times"][0], "stream_gap_before_s": {"median": statistics.median(before),
                                                                      "max": max(before)},
           "stream_gap_during_s": {"median": statistics.median(during) if during else None,
                                   "max": max(during) if during else None, "n": len(during)}}
    write_json(Path(a.out).with_suffix(".json"), out)
    lines = [f"# A long paste beside a stream ({a.model})", "", f"`{command_line()}` at {out['commit'][:10]}"
             f"{' (dirty)' if out['dirty'] else ''}", "",
             f"- paste: {out['paste_prompt_tokens']} prompt tokens, TTFT {out['paste_ttft_s']:.2f} s",
             f"- streaming user, gap between tokens before the paste: median {1000 * statistics.median(before):.0f} ms,"
             f" longest {1000 * max(before):.0f} ms",
             f"- during the paste's prefill ({len(during)} gaps): median "
             f"{1000 * out['stream_gap_during_s']['median']:.0f} ms, longest "
             f"{1000 * out['stream_gap_during_s']['max']:.0f} ms"]
    Path(a.out).with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
