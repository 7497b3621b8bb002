"""Speed metrics from the timestamped chunks of a streamed response (definitions and their peers in docs/lab.md).

Times are seconds from sending the request. A chunk may carry several tokens (speculative decoding, server-side
batching of deltas): every per-token figure counts tokens, not chunks.

    TTFT            first chunk carrying any token, reasoning included (role-only chunks carry none)
    TTFC            first chunk carrying answer content (reasoning excluded)
    output tok/s    (N - tokens of the first chunk) / (t_last - t_first)      Artificial Analysis' output speed
    TPOT            (e2e - TTFT) / (N - 1)                                     vLLM's benchmark_serving
    ITL             each chunk after the first: gap to the previous chunk / its tokens, one sample per token
    window floor    the slowest stretch of `window` consecutive decode tokens inside one response, in tok/s
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass

import numpy as np

from fastdecode.lab.records import Chunk, RequestRecord

WINDOW_TOKENS = 32  # a stall of a few hundred ms shows in a 32-token window; a shorter one is mostly noise


@dataclass
class RequestMetrics:
    ttft_s: float
    ttfc_s: float | None  # None when the answer held reasoning only
    e2e_s: float
    output_tokens: float
    prompt_tokens: float | None
    output_tok_s: float | None  # None for a single-chunk answer: no decode time to divide by
    tpot_s: float | None
    window_floor_tok_s: float | None  # None when the answer has fewer than `window` decode tokens
    itl_s: list[float]  # one sample per decode token
    end_at: float  # seconds from the start of the run to the end of this response


@dataclass
class Stats:
    n: int
    mean: float
    median: float
    p5: float  # the floor of a speed: 95% of samples are faster
    p95: float
    p99: float
    min: float
    max: float

    def as_dict(self) -> dict:
        return asdict(self)


def request_metrics(r: RequestRecord, window: int = WINDOW_TOKENS) -> RequestMetrics | None:
    """Metrics of one successful request; None for a failed one (counted apart, in `summarize`)."""
    chunks = [c for c in r.chunks if c.tokens > 0]
    if not r.ok or not chunks:
        return None
    first, last = chunks[0], chunks[-1]
    n = sum(c.tokens for c in chunks)
    content = next((c for c in chunks if c.content), None)
    e2e = r.end_s if r.end_s is not None else last.t
    decode_tokens, decode_s = n - first.tokens, last.t - first.t
    return RequestMetrics(
        ttft_s=first.t, ttfc_s=content.t if content else None, e2e_s=e2e, output_tokens=n,
        prompt_tokens=r.prompt_tokens,
        output_tok_s=decode_tokens / decode_s if decode_tokens > 0 and decode_s > 0 else None,
        tpot_s=(e2e - first.t) / (n - 1) if n > 1 else None,
        window_floor_tok_s=slowest_window(chunks, window), itl_s=itl_samples(chunks), end_at=r.sent_at + e2e)


def itl_samples(chunks: list[Chunk]) -> list[float]:
    """A chunk of k tokens arriving `gap` after the previous one gives k samples of gap / k."""
    out = []
    for prev, c in zip(chunks, chunks[1:]):
        out += [(c.t - prev.t) / c.tokens] * max(1, round(c.tokens))
    return out


def slowest_window(chunks: list[Chunk], window: int) -> float | None:
    """Lowest tok/s over any stretch of at least `window` decode tokens, stretches running chunk to chunk.
    Decode tokens are those after the first chunk (its wait is TTFT, not decode)."""
    times = [c.t for c in chunks]
    cum = np.cumsum([0.0] + [c.tokens for c in chunks[1:]])  # cum[i]: decode tokens up to and including chunk i
    if cum[-1] < window:
        return None
    worst, j = float("inf"), 0
    for i in range(1, len(chunks)):
        while j + 1 < i and cum[i] - cum[j + 1] >= window:  # the shortest stretch ending at i that holds `window`
            j += 1
        if cum[i] - cum[j] >= window and times[i] > times[j]:
            worst = min(worst, (cum[i] - cum[j]) / (times[i] - times[j]))
    return worst if worst != float("inf") else None


def stats(values) -> Stats | None:
    v = np.asarray([x for x in values if x is not None], dtype=float)
    if v.size == 0:
        return None
    p5, median, p95, p99 = np.percentile(v, [5, 50, 95, 99])
    return Stats(int(v.size), float(v.mean()), float(median), float(p5), float(p95), float(p99), float(v.min()),
                 float(v.max()))


METRICS = ("ttft_s", "ttfc_s", "e2e_s", "output_tok_s", "tpot_s", "window_floor_tok_s", "output_tokens",
           "prompt_tokens")


def summarize_group(records: list[RequestRecord], window: int = WINDOW_TOKENS) -> dict:
    """Stats of every metric over `records`, errors counted, and the throughput of the group as a whole."""
    measured = [(r, m) for r in records if (m := request_metrics(r, window)) is not None]
    ms = [m for _, m in measured]
    out = {"requests": len(records), "ok": len(ms), "errors": len(records) - len(ms),
           "error_kinds": error_kinds(records)}
    for name in METRICS:
        s = stats(getattr(m, name) for m in ms)
        out[name] = s.as_dict() if s else None
    itl = stats(x for m in ms for x in m.itl_s)
    out["itl_s"] = itl.as_dict() if itl else None
    if records:
        start = min(r.sent_at for r in records)
        end = max((m.end_at for m in ms), default=start)
        out["duration_s"] = end - start
        out["throughput_tok_s"] = sum(m.output_tokens for m in ms) / (end - start) if end > start else None
    return out


def busy_throughput(records: list[RequestRecord]) -> float | None:
    """Output tokens/s while every user of a sweep level had work: from the first request sent to the moment the
    first user ran out of requests (None for fewer than two users). The level's throughput also counts its tail, in
    which fewer users remain: with a few requests per user and uneven lengths, a large share of it."""
    ends: dict[int, float] = {}
    for r in records:
        ends[r.user] = max(ends.get(r.user, 0.0), r.sent_at + r.end_s)
    if len(ends) < 2:
        return None
    start, end = min(r.sent_at for r in records), min(ends.values())
    tokens = sum(c.tokens for r in records if r.ok for c in r.chunks if r.sent_at + c.t <= end)
    return tokens / (end - start) if end > start else None


def error_kinds(records: list[RequestRecord]) -> dict[str, int]:
    kinds: dict[str, int] = defaultdict(int)
    for r in records:
        if not r.ok:
            kinds[(r.error or "no tokens in the stream").split(":")[0]] += 1
    return dict(kinds)


def group_by(items: list, key) -> dict:
    groups = defaultdict(list)
    for item in items:
        groups[key(item)].append(item)
    return dict(groups)


def soak_series(records: list[RequestRecord], interval_s: float, window: int = WINDOW_TOKENS) -> list[dict]:
    """Median output tok/s of the responses that ended in each `interval_s` bin: speed over time."""
    ms = [m for r in records if (m := request_metrics(r, window)) and m.output_tok_s is not None]
    if not ms:
        return []
    start = min(r.sent_at for r in records)
    bins = group_by(ms, lambda m: int((m.end_at - start) // interval_s))
    return [{"t_s": (b + 0.5) * interval_s, "median_tok_s": float(np.median([m.output_tok_s for m in group])),
             "requests": len(group)} for b, group in sorted(bins.items())]


def summarize(records: list[RequestRecord], window: int = WINDOW_TOKENS, interval_s: float = 10.0) -> dict:
    """The whole run: overall, per category, per phase (sweep levels), per arm (compare), and speed over time."""
    out = {"overall": summarize_group(records, window), "window_tokens": window}
    categories = sorted(group_by(records, lambda r: r.category).items())
    out["by_category"] = {c: summarize_group(rs, window) for c, rs in categories}
    phases = group_by(records, lambda r: r.phase)
    out["by_phase"] = {p: level_summary(rs, window) if p.startswith("c=") else
                       {**summarize_group(rs, window), "concurrency": rs[0].concurrency} for p, rs in phases.items()}
    if any(r.arm for r in records):
        out["by_arm"] = {a: summarize_group(rs, window) for a, rs in sorted(group_by(records, lambda r: r.arm).items())}
        out["compare"] = paired_comparison(records, window)
    out["speed_over_time"] = soak_series(records, interval_s, window)
    return out


def level_summary(records: list[RequestRecord], window: int = WINDOW_TOKENS) -> dict:
    """A sweep level over all its passes: every per-request statistic over all its requests; its throughputs pass by
    pass (a pass spans only itself: the other levels' passes ran in between), then their median."""
    out = {**summarize_group(records, window), "concurrency": records[0].concurrency}
    passes = [rs for _, rs in sorted(group_by(records, lambda r: r.repeat).items())]
    per_pass = [summarize_group(rs, window) for rs in passes]
    throughputs = [g["throughput_tok_s"] for g in per_pass if g.get("throughput_tok_s")]
    busy = [b for rs in passes if (b := busy_throughput(rs)) is not None]
    out.update(duration_s=sum(g.get("duration_s", 0.0) for g in per_pass),
               throughput_tok_s=float(np.median(throughputs)) if throughputs else None,
               busy_throughput_tok_s=float(np.median(busy)) if busy else None, passes=len(passes))
    if len(passes) > 1:
        out.update(throughput_passes_tok_s=throughputs, busy_throughput_passes_tok_s=busy)
    return out


def sweep_rows(summary: dict) -> list[dict]:
    """Per concurrency level: per-user output speed (median over requests) and total throughput (median over
    passes, with their range), each also against the lowest level's."""
    rows = []
    for phase, s in summary["by_phase"].items():
        if phase.startswith("c="):
            speed = s["output_tok_s"]
            rows.append({"concurrency": s["concurrency"], "per_user_tok_s": speed["median"] if speed else None,
                         "per_user_floor_tok_s": speed["p5"] if speed else None,
                         "throughput_tok_s": s.get("throughput_tok_s"),
                         "throughput_passes_tok_s": s.get("throughput_passes_tok_s"),
                         "busy_throughput_tok_s": s.get("busy_throughput_tok_s"),
                         "ttft_s": s["ttft_s"]["median"] if s["ttft_s"] else None, "errors": s["errors"]})
    rows.sort(key=lambda row: row["concurrency"])
    for row in rows:
        for key in ("per_user_tok_s", "throughput_tok_s"):
            first = rows[0][key]
            row[key.replace("_tok_s", "_vs_first")] = row[key] / first if row[key] and first else None
    return rows


def paired_comparison(records: list[RequestRecord], window: int = WINDOW_TOKENS) -> dict:
    """B against A over interleaved pairs (A then B on the same work item): the median of the per-pair speed ratios
    cancels drift that a ratio of two medians taken minutes apart would keep."""
    a_runs = [r for r in records if r.arm == "A"]
    b_runs = [r for r in records if r.arm == "B"]
    ratios, ttft_ratios = [], []
    for a, b in zip(a_runs, b_runs):
        ma, mb = request_metrics(a, window), request_metrics(b, window)
        if ma and mb and ma.output_tok_s and mb.output_tok_s:
            ratios.append(mb.output_tok_s / ma.output_tok_s)
        if ma and mb and ma.ttft_s > 0:
            ttft_ratios.append(mb.ttft_s / ma.ttft_s)
    return {"pairs": len(ratios),
            "speed_ratio_b_over_a": float(np.median(ratios)) if ratios else None,
            "speed_ratio_p5": float(np.percentile(ratios, 5)) if ratios else None,
            "speed_ratio_p95": float(np.percentile(ratios, 95)) if ratios else None,
            "ttft_ratio_b_over_a": float(np.median(ttft_ratios)) if ttft_ratios else None}
