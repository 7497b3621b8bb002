"""Runs round-trip through SQLite with their raw per-chunk timings intact."""
import pytest

from fastdecode.lab.records import Chunk, RequestRecord
from fastdecode.lab.storage import RunNotFoundError, list_runs, load_run, save_run


def test_records_round_trip_with_chunk_texts_and_timings(tmp_path):
    db = tmp_path / "lab.sqlite"
    ok = RequestRecord("a", "code_edit", phase="c=2", user=1, concurrency=2, max_tokens=64, sent_at=0.5,
                       sent_unix=1.7e9, chunks=[Chunk(0.1, "def", "", 1.0), Chunk(0.2, " f", "", 1.0),
                                                Chunk(0.3, "", "hmm", 2.0)],
                       end_s=0.35, prompt_tokens=30, output_tokens=4, token_source="usage",
                       usage={"completion_tokens": 4}, finish_reason="stop", status=200)
    failed = RequestRecord("b", "refactor", error="http 500: boom", status=500, end_s=0.01)
    run_id = save_run(db, "label", ["sweep"], "http://x", {"k": 1}, {"python": "3"}, {"overall": {}}, [ok, failed])
    run = load_run(db, run_id)
    assert run.records == [ok, failed] and run.config == {"k": 1} and run.label == "label"
    assert load_run(db, "last").id == run_id and [r["id"] for r in list_runs(db)] == [run_id]
    with pytest.raises(RunNotFoundError):
        load_run(db, 99)
    with pytest.raises(RunNotFoundError):
        load_run(db, "x")


def test_a_database_from_before_the_repeat_column_opens_and_reads_its_records_as_the_first_pass(tmp_path):
    import sqlite3

    from fastdecode.lab import storage

    db = tmp_path / "old.sqlite"
    old_schema = storage.SCHEMA.replace("    repeat INTEGER DEFAULT 0,\n", "")
    assert old_schema != storage.SCHEMA
    with sqlite3.connect(db) as con:
        con.executescript(old_schema)
        con.execute("INSERT INTO runs VALUES (1, 'then', 'old', 'sweep', 't', '{}', '{}', '{}')")
        con.execute("INSERT INTO requests VALUES (1, 0, 'a', 'c', 'c=1', '', 0, 1, 8, 0.0, 0.0, 0.1, 3, 1, 'usage', "
                    "'null', 'stop', 200, NULL, '[[0.05, 1, 2, 0]]', 'hi', '')")
    assert load_run(db, 1).records[0].repeat == 0 and load_run(db, 1).records[0].content == "hi"
    later = RequestRecord("b", "c", phase="c=2", repeat=2, chunks=[Chunk(0.1, "x", "", 1.0)], end_s=0.2)
    assert load_run(db, save_run(db, "", ["sweep"], "t", {}, {}, {}, [later])).records == [later]
