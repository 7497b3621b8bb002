"""The speed lab: measures any OpenAI-compatible chat endpoint, or a local model that it serves itself, on coding-agent
workloads, from the timestamped chunks of each SSE stream (metric definitions in docs/lab.md).

    client.py        one streamed request, a timestamp per chunk; the endpoint check before a run
    tokens.py        token counts: the server's usage, else a tokenizer
    metrics.py       TTFT, output tok/s, TPOT, ITL, floors; aggregates per category, phase, arm
    plan.py          work items: bundled, a JSONL file, or synthetic; the unique-prompt nonce
    runner.py        modes: sequential, sweep, soak, compare
    local_server.py  `fastdecode serve` started and stopped around a run
    ceiling.py       the roofline ceiling for the plots
    cost.py          dollars per request and per task
    storage.py       runs in SQLite
    report.py        the self-contained HTML report
    tables.py, cli.py  the terminal side: `fastdecode bench`
"""
