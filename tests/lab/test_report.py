"""The HTML report is one self-contained file whose plots render: decoded here as PNGs, and shown in headless
Chromium (Debian's /usr/bin/chromium driven by playwright) where the machine has it."""
import base64
import io
from html.parser import HTMLParser

import pytest

from fastdecode.lab.metrics import summarize
from fastdecode.lab.records import Chunk, RequestRecord
from fastdecode.lab.report import write_report
from fastdecode.lab.storage import load_run, save_run
from tests.helpers.chromium import headless_chromium

PLOTS = ["speed-by-category", "speed-over-time", "concurrency", "ttft-vs-speed", "compare"]


def fake_records():
    records, t = [], 0.0
    for i in range(12):
        phase, c, arm = [("sequential", 1, ""), ("c=1", 1, ""), ("c=2", 2, ""), ("compare", 1, "AB"[i % 2])][i // 3]
        speed = 40 - 3 * c + (5 if arm == "B" else 0)
        chunks = [Chunk(0.1 + i * 0.01 + k / speed, "tok", "", 1.0) for k in range(40)]
        records.append(RequestRecord(f"item{i % 3}", ["code_edit", "explanation", "low_overlap"][i % 3], phase=phase,
                                     arm=arm, concurrency=c, sent_at=t, chunks=chunks, end_s=chunks[-1].t + 0.01,
                                     prompt_tokens=100, output_tokens=40, token_source="usage"))
        t += chunks[-1].t
    records.append(RequestRecord("item0", "code_edit", phase="sequential", error="timeout: no complete answer"))
    return records


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("report")
    records = fake_records()
    summary = summarize(records, window=16, interval_s=2.0)
    summary["ceiling"] = {"tok_s": 60.0, "label": "roofline 60 tok/s (test)"}
    run_id = save_run(tmp / "lab.sqlite", "test run", ["sequential", "sweep", "compare"], "http://x", {}, {},
                      summary, records)
    return write_report(load_run(tmp / "lab.sqlite", run_id), tmp / "report.html")


class Images(HTMLParser):
    def __init__(self):
        super().__init__()
        self.figures, self.external, self.current = {}, [], None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "figure":
            self.current = a.get("id")
        if tag == "img":
            self.figures[self.current] = a["src"]
        if tag in ("script", "link") or (a.get("src") or "").startswith("http"):
            self.external.append(tag)


def test_report_is_self_contained_with_every_plot_a_valid_png(report):
    import matplotlib.image

    parser = Images()
    parser.feed(report.read_text())
    assert sorted(parser.figures) == sorted(f"plot-{p}" for p in PLOTS) and parser.external == []
    for src in parser.figures.values():
        assert src.startswith("data:image/png;base64,")
        image = matplotlib.image.imread(io.BytesIO(base64.b64decode(src.split(",", 1)[1])), format="png")
        assert image.shape[0] > 200 and image.shape[1] > 300
    html = report.read_text()
    assert "roofline 60 tok/s" in html and "timeout" in html and "Concurrency sweep" in html


def test_report_renders_in_headless_chromium(report, tmp_path):
    with headless_chromium() as browser:
        page = browser.new_page(viewport={"width": 1200, "height": 900})
        page.goto(report.as_uri())
        figures = page.evaluate("""() => [...document.querySelectorAll('figure')].map(f => {
            const img = f.querySelector('img'); const box = img.getBoundingClientRect();
            return [f.id, img.complete, img.naturalWidth, img.naturalHeight, box.width, box.height]; })""")
        page.screenshot(path=str(tmp_path / "report.png"), full_page=True)
    assert [f[0] for f in figures] == [f"plot-{p}" for p in PLOTS]
    for fid, complete, nw, nh, w, h in figures:
        assert complete and nw > 300 and nh > 200 and w > 100 and h > 100, fid  # decoded and laid out
    assert (tmp_path / "report.png").stat().st_size > 10_000
