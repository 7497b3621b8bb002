"""The schema suite (tests/data/schema_suite.jsonl, issue 43) against the main server on SmolLM2-135M: every schema's
sampled reply under `response_format: json_schema` is valid against its schema (jsonschema, Draft 2020-12, formats
checked) or was cut by max_tokens. The requests and the checks are bench/schema_suite.py's, which reports the same
suite per feature."""
import pytest

pytest.importorskip("jsonschema")

from bench.schema_suite import failures, load_suite, run_suite, tally  # noqa: E402
from tests.server.conftest import API_KEY  # noqa: E402


def test_every_schema_reply_is_valid_or_cut_by_max_tokens(server):
    entries = load_suite()
    _, replies = run_suite(server.base_url, API_KEY, entries, max_tokens=384, in_flight=8)
    bad = failures(replies)
    totals = dict(tally(replies)["total"])
    print(f"schema suite: {totals} of {len(replies)}")
    assert not bad, f"{len(bad)} of {len(entries)} replies neither valid nor cut by max_tokens ({totals}):\n" + \
        "\n".join(bad)
