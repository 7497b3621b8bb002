"""Published single-user speeds against the calculated ceiling (the docs' validation table)."""
from fastdecode.roofline.validation import markdown, validation_rows


def test_every_non_speculative_published_figure_is_below_its_ceiling():
    rows = validation_rows()
    plain = [r for r in rows if r["kind"] == "plain"]
    assert len(plain) >= 8
    over = [(r["system"], r["model"], r["efficiency"]) for r in plain if r["efficiency"] >= 1]
    assert not over


def test_the_speculative_figure_may_pass_the_plain_ceiling_and_calibration_meets_it():
    rows = validation_rows()
    assert any(r["kind"] == "speculative" and r["efficiency"] > 1 for r in rows)  # gpt-fast 70B int4 + draft
    (hc1,) = [r for r in rows if r["kind"] == "calibration"]
    assert abs(hc1["efficiency"] - 1) < 0.01


def test_markdown_table_has_a_row_per_figure():
    rows = validation_rows()
    assert len(markdown(rows).splitlines()) == len(rows) + 2
