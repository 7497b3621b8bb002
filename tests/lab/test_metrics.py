"""Metric definitions on synthetic timestamp sequences: single- and multi-token chunks, reasoning, stalls."""
import pytest

from fastdecode.lab.metrics import (paired_comparison, request_metrics, slowest_window, soak_series, stats,
                                    summarize, sweep_rows)
from fastdecode.lab.records import Chunk, RequestRecord
from fastdecode.lab.tokens import TokenCounter, apportion, assign_tokens


def record(chunks, end_s=None, **fields) -> RequestRecord:
    """chunks: (t, tokens) or (t, tokens, 'reasoning')."""
    out = []
    for c in chunks:
        t, n, kind = (*c, "content") if len(c) == 2 else c
        out.append(Chunk(t, "x" if kind == "content" else "", "x" if kind == "reasoning" else "", n))
    return RequestRecord("item", fields.pop("category", "code_edit"), chunks=out,
                         end_s=end_s if end_s is not None else out[-1].t, **fields)


def test_one_token_chunks_give_aa_speed_vllm_tpot_and_per_token_itl():
    # first token at 0.5 s, then 10 tokens every 0.1 s; the stream closes 0.05 s after the last
    m = request_metrics(record([(0.5 + 0.1 * i, 1) for i in range(11)], end_s=1.55))
    assert m.ttft_s == pytest.approx(0.5) and m.ttfc_s == pytest.approx(0.5)
    assert m.output_tokens == 11
    assert m.output_tok_s == pytest.approx(10.0)  # 10 decode tokens over 1.0 s; TTFT excluded
    assert m.tpot_s == pytest.approx((1.55 - 0.5) / 10)  # vLLM: (e2e - TTFT) / (N - 1)
    assert m.itl_s == pytest.approx([0.1] * 10)
    assert m.e2e_s == pytest.approx(1.55)


def test_multi_token_chunks_count_tokens_not_chunks():
    # first chunk 1 token at 0.2 s, then 4 chunks of 3 tokens every 0.3 s: 12 tokens in 1.2 s
    m = request_metrics(record([(0.2, 1)] + [(0.2 + 0.3 * i, 3) for i in range(1, 5)]))
    assert m.output_tokens == 13
    assert m.output_tok_s == pytest.approx(10.0)
    assert m.itl_s == pytest.approx([0.1] * 12)  # each 3-token chunk: three samples of 0.3 / 3
    assert m.tpot_s == pytest.approx(1.2 / 12)


def test_first_chunk_with_several_tokens_belongs_to_ttft():
    m = request_metrics(record([(1.0, 5), (1.5, 1), (2.0, 1)]))
    assert m.ttft_s == 1.0 and m.output_tokens == 7
    assert m.output_tok_s == pytest.approx(2 / 1.0)  # the 5 tokens that arrived with the first chunk don't count


def test_reasoning_tokens_count_for_ttft_and_speed_but_not_first_content():
    chunks = [(0.3 + 0.05 * i, 1, "reasoning") for i in range(10)] + [(0.8 + 0.05 * i, 1) for i in range(10)]
    m = request_metrics(record(chunks))
    assert m.ttft_s == pytest.approx(0.3)
    assert m.ttfc_s == pytest.approx(0.8)  # time to first answer token
    assert m.output_tokens == 20
    assert m.output_tok_s == pytest.approx(19 / (1.25 - 0.3))


def test_reasoning_only_answer_has_no_first_content():
    m = request_metrics(record([(0.1, 1, "reasoning"), (0.2, 1, "reasoning")]))
    assert m.ttfc_s is None and m.ttft_s == pytest.approx(0.1)


def test_single_chunk_answer_has_no_decode_speed():
    m = request_metrics(record([(0.4, 1)]))
    assert m.output_tok_s is None and m.tpot_s is None and m.itl_s == []


def test_failed_requests_have_no_metrics_but_are_counted():
    ok = record([(0.1, 1), (0.2, 1)])
    failed = RequestRecord("item", "code_edit", error="timeout: no complete answer within 1 s", end_s=1.0)
    assert request_metrics(failed) is None
    s = summarize([ok, failed])
    assert s["overall"]["requests"] == 2 and s["overall"]["ok"] == 1 and s["overall"]["errors"] == 1
    assert s["overall"]["error_kinds"] == {"timeout": 1}


def test_slowest_window_finds_a_stall_inside_the_response():
    # 100 tokens at 100 tok/s with a 0.5 s stall after token 50; window of 10 tokens
    times, t = [0.0], 0.0
    for i in range(1, 100):
        t += 0.01 + (0.5 if i == 50 else 0.0)
        times.append(t)
    chunks = [Chunk(x, "x", "", 1) for x in times]
    assert slowest_window(chunks, 10) == pytest.approx(10 / (0.09 + 0.51))  # the window holding the stall
    assert request_metrics(RequestRecord("i", "c", chunks=chunks, end_s=t)).output_tok_s == pytest.approx(99 / t)
    assert slowest_window(chunks[:5], 10) is None  # shorter than the window


def test_slowest_window_over_multi_token_chunks():
    chunks = [Chunk(0.0, "x", "", 1)] + [Chunk(0.1 * i, "x", "", 4) for i in range(1, 11)]  # 40 tok/s steady
    assert slowest_window(chunks, 8) == pytest.approx(40.0)


def test_stats_give_mean_median_floor_and_tails():
    s = stats(range(1, 101))
    assert (s.n, s.mean, s.median, s.min, s.max) == (100, 50.5, 50.5, 1, 100)
    assert s.p5 == pytest.approx(5.95) and s.p95 == pytest.approx(95.05) and s.p99 == pytest.approx(99.01)
    assert stats([None, None]) is None


def test_apportion_is_exact_for_one_token_per_chunk_and_scales_otherwise():
    assert apportion([2.0, 1.0, 2.0], 3) == [1.0, 1.0, 1.0]  # usage says one token per chunk
    assert apportion([1.0, 3.0], 8) == [2.0, 6.0]
    assert apportion([1.0, 3.0], None) == [1.0, 3.0]


def test_assign_tokens_prefers_usage_and_falls_back_to_the_tokenizer():
    words = TokenCounter("tokenizer:words", lambda text: len(text.split()), lambda msgs: 99)
    r = RequestRecord("i", "c", chunks=[Chunk(0.1, "a b"), Chunk(0.2, "c"), Chunk(0.3, "", "d e f")],
                      usage={"prompt_tokens": 7, "completion_tokens": 12})
    assign_tokens(r, words, [{"role": "user", "content": "hi"}])
    assert [c.tokens for c in r.chunks] == pytest.approx([4, 2, 6]) and r.output_tokens == 12
    assert r.prompt_tokens == 7 and r.token_source == "usage"
    r.usage = None
    assign_tokens(r, words, [{"role": "user", "content": "hi"}])
    assert [c.tokens for c in r.chunks] == [2, 1, 3] and r.prompt_tokens == 99 and r.token_source == "tokenizer:words"


def test_summary_groups_by_category_and_sweep_level():
    rs = [record([(0.1, 1), (0.2, 1)], category="a", phase="c=1", concurrency=1),
          record([(0.1, 1), (0.3, 1)], category="b", phase="c=2", concurrency=2, sent_at=1.0),
          record([(0.1, 1), (0.3, 1)], category="b", phase="c=2", concurrency=2, user=1, sent_at=1.0)]
    s = summarize(rs)
    assert set(s["by_category"]) == {"a", "b"} and s["by_category"]["b"]["requests"] == 2
    rows = sweep_rows(s)
    assert [r["concurrency"] for r in rows] == [1, 2]
    assert rows[0]["per_user_tok_s"] == pytest.approx(10.0) and rows[1]["per_user_tok_s"] == pytest.approx(5.0)
    assert rows[1]["throughput_tok_s"] == pytest.approx(4 / 0.3)  # 4 tokens from t=1.0 to t=1.3


def test_a_levels_throughput_is_the_median_of_its_passes_and_rows_compare_with_the_lowest_level():
    # c=1: one pass, 2 tokens in 0.2 s. c=2: three passes of two users, each pass on its own stretch of the run
    # (the other levels' passes in between), with 4 tokens in 0.3, 0.4 and 0.8 s.
    rs = [record([(0.1, 1), (0.2, 1)], phase="c=1", concurrency=1)]
    for repeat, (start, span) in enumerate([(1.0, 0.3), (5.0, 0.4), (9.0, 0.8)]):
        rs += [record([(0.1, 1), (span, 1)], phase="c=2", concurrency=2, user=u, sent_at=start, repeat=repeat)
               for u in (0, 1)]
    level = summarize(rs)["by_phase"]["c=2"]
    assert level["passes"] == 3 and level["throughput_passes_tok_s"] == pytest.approx([4 / 0.3, 4 / 0.4, 4 / 0.8])
    assert level["throughput_tok_s"] == pytest.approx(4 / 0.4)  # not 12 tokens over the 8.8 s the passes span
    assert level["duration_s"] == pytest.approx(0.3 + 0.4 + 0.8) and level["requests"] == 6
    one, two = sweep_rows(summarize(rs))
    assert one["throughput_vs_first"] == 1.0 and one["throughput_passes_tok_s"] is None
    assert two["throughput_vs_first"] == pytest.approx((4 / 0.4) / (2 / 0.2))
    speeds = sorted(1 / (span - 0.1) for span in (0.3, 0.4, 0.8))  # each request's one token after its first
    assert two["per_user_tok_s"] == pytest.approx(speeds[1]) and two["per_user_vs_first"] == pytest.approx(speeds[1] / 10)


def test_paired_comparison_takes_the_median_ratio_of_interleaved_pairs():
    rs = []
    for i in range(4):  # B is twice as fast as A in every pair, while the machine drifts slower over time
        slow = 1 + i
        rs.append(record([(0.1, 1), (0.1 + 0.1 * slow, 1)], arm="A", phase="compare"))
        rs.append(record([(0.1, 1), (0.1 + 0.05 * slow, 1)], arm="B", phase="compare"))
    c = paired_comparison(rs)
    assert c["pairs"] == 4 and c["speed_ratio_b_over_a"] == pytest.approx(2.0)


def test_speed_over_time_is_a_median_per_interval():
    rs = [record([(0.0, 1), (0.1, 1)], sent_at=t) for t in (0.0, 1.0, 12.0)]
    series = soak_series(rs, interval_s=10.0)
    assert [p["requests"] for p in series] == [2, 1] and series[0]["median_tok_s"] == pytest.approx(10.0)


def test_busy_throughput_stops_when_the_first_user_runs_out_of_requests():
    # user 0: one request of 4 tokens ending at t=1.0; user 1: 10 tokens from t=0.1 to t=2.0, 5 of them by t=1.0
    rs = [record([(0.25 * i, 1) for i in range(1, 5)], phase="c=2", concurrency=2, user=0),
          record([(0.1 + 0.2 * i, 1) for i in range(10)], end_s=2.0, phase="c=2", concurrency=2, user=1)]
    row = sweep_rows(summarize(rs))[0]
    assert row["busy_throughput_tok_s"] == pytest.approx((4 + 5) / 1.0)
    assert row["throughput_tok_s"] == pytest.approx(14 / 2.0)  # the tail, user 1 alone, counted
