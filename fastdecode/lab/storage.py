"""Runs kept in SQLite (default $FASTDECODE_HOME/lab.sqlite): each run's configuration, environment and summary,
and every request with its raw per-chunk timings, so `bench show` and `bench compare` recompute the metrics from
the same raw data under the current definitions."""
from __future__ import annotations

import json
import sqlite3
from contextlib import closing
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from fastdecode.errors import FastdecodeError
from fastdecode.lab.records import Chunk, RequestRecord
from fastdecode.loading.catalog import fastdecode_home

SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    created_at TEXT NOT NULL,
    label TEXT,
    modes TEXT,
    target TEXT,
    config TEXT,        -- JSON: everything the command line set
    environment TEXT,   -- JSON: machine, versions, server command
    summary TEXT        -- JSON: metrics.summarize at the time of the run
);
CREATE TABLE IF NOT EXISTS requests (
    run_id INTEGER NOT NULL REFERENCES runs(id),
    seq INTEGER NOT NULL,
    item_id TEXT, category TEXT, phase TEXT, arm TEXT, user INTEGER, concurrency INTEGER, max_tokens INTEGER,
    sent_at REAL, sent_unix REAL, end_s REAL,
    prompt_tokens REAL, output_tokens REAL, token_source TEXT, usage TEXT, finish_reason TEXT,
    status INTEGER, error TEXT,
    chunks TEXT,        -- JSON [[t, tokens, content chars, reasoning chars], ...]
    content TEXT, reasoning TEXT,
    repeat INTEGER DEFAULT 0,
    PRIMARY KEY (run_id, seq)
);
"""
# Columns added since a table's first version: a database written before gets them (at their defaults) when opened.
ADDED_COLUMNS = {"requests": {"repeat": "INTEGER DEFAULT 0"}}


class RunNotFoundError(FastdecodeError):
    """`bench show` or `bench compare` named a run the database does not hold."""


@dataclass
class StoredRun:
    id: int
    created_at: str
    label: str
    modes: str
    target: str
    config: dict
    environment: dict
    summary: dict
    records: list[RequestRecord]


def default_db() -> Path:
    return fastdecode_home() / "lab.sqlite"


def connect(path: str | Path | None) -> sqlite3.Connection:
    path = Path(path) if path else default_db()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(path)
        db.executescript(SCHEMA)
        for table, columns in ADDED_COLUMNS.items():
            have = {row[1] for row in db.execute(f"PRAGMA table_info({table})")}
            for name, kind in columns.items():
                if name not in have:
                    db.execute(f"ALTER TABLE {table} ADD COLUMN {name} {kind}")
    except (OSError, sqlite3.Error) as e:
        raise FastdecodeError(f"cannot open the lab database {path}: {e}") from None
    return db


def save_run(path, label: str, modes: list[str], target: str, config: dict, environment: dict, summary: dict,
             records: list[RequestRecord]) -> int:
    with closing(connect(path)) as db, db:
        cur = db.execute(
            "INSERT INTO runs (created_at, label, modes, target, config, environment, summary) VALUES (?,?,?,?,?,?,?)",
            (datetime.now(timezone.utc).isoformat(timespec="seconds"), label, ",".join(modes), target,
             json.dumps(config), json.dumps(environment), json.dumps(summary)))
        run_id = cur.lastrowid
        rows = [(run_id, i, *record_row(r)) for i, r in enumerate(records)]
        if rows:
            db.executemany(f"INSERT INTO requests VALUES ({','.join('?' * len(rows[0]))})", rows)
    return run_id


def record_row(r: RequestRecord) -> tuple:
    chunks = [[c.t, c.tokens, len(c.content), len(c.reasoning)] for c in r.chunks]
    return (r.item_id, r.category, r.phase, r.arm, r.user, r.concurrency, r.max_tokens, r.sent_at, r.sent_unix,
            r.end_s, r.prompt_tokens, r.output_tokens, r.token_source, json.dumps(r.usage), r.finish_reason,
            r.status, r.error, json.dumps(chunks), r.content, r.reasoning, r.repeat)


def row_record(row) -> RequestRecord:
    (item_id, category, phase, arm, user, concurrency, max_tokens, sent_at, sent_unix, end_s, prompt_tokens,
     output_tokens, token_source, usage, finish_reason, status, error, chunks, content, reasoning, repeat) = row
    out, ci, ri = [], 0, 0
    for t, tokens, nc, nr in json.loads(chunks):
        out.append(Chunk(t, content[ci:ci + nc], reasoning[ri:ri + nr], tokens))
        ci, ri = ci + nc, ri + nr
    return RequestRecord(item_id, category, phase, arm, user, concurrency, max_tokens, sent_at, sent_unix, out, end_s,
                         prompt_tokens, output_tokens, token_source, json.loads(usage), finish_reason, status, error,
                         repeat or 0)


def list_runs(path) -> list[dict]:
    with closing(connect(path)) as db:
        rows = db.execute("SELECT id, created_at, label, modes, target, summary FROM runs ORDER BY id").fetchall()
    return [{"id": i, "created_at": c, "label": lb, "modes": m, "target": t, "summary": json.loads(s)}
            for i, c, lb, m, t, s in rows]


def load_run(path, run_id: int | str) -> StoredRun:
    with closing(connect(path)) as db:
        if str(run_id) == "last":
            row = db.execute("SELECT * FROM runs ORDER BY id DESC LIMIT 1").fetchone()
        else:
            try:
                row = db.execute("SELECT * FROM runs WHERE id = ?", (int(run_id),)).fetchone()
            except ValueError:
                raise RunNotFoundError(f"run {run_id!r} is not a number (see `fastdecode bench list`)") from None
        if row is None:
            raise RunNotFoundError(f"no run {run_id} in {path or default_db()} (see `fastdecode bench list`)")
        rows = db.execute("SELECT * FROM requests WHERE run_id = ? ORDER BY seq", (row[0],)).fetchall()
    i, created, label, modes, target, config, env, summary = row
    return StoredRun(i, created, label or "", modes, target, json.loads(config), json.loads(env), json.loads(summary),
                     [row_record(r[2:]) for r in rows])
