"""Feeding a reply parser: whole, split at every position, or one character at a time, with the events compared in
a form that ignores where the text was split and the calls' random ids."""
from __future__ import annotations

import json


def run(parser, pieces) -> list[tuple[str, object]]:
    """Events with adjacent text of one kind joined and each call as (name, arguments)."""
    events = []
    for piece in pieces:
        events += parser.feed(piece)
    events += parser.finish()
    out = []
    for kind, value in events:
        if kind == "tool_call":
            out.append((kind, (value["function"]["name"], json.loads(value["function"]["arguments"]))))
        elif out and out[-1][0] == kind:
            out[-1] = (kind, out[-1][1] + value)
        else:
            out.append((kind, value))
    return out


def run_every_split(make_parser, text: str) -> list[tuple[str, object]]:
    """The events of `text` fed whole, after checking that every two-piece split and a character-by-character feed
    give the same: nothing held back is lost, and no half marker or half call comes out as text early."""
    whole = run(make_parser(), [text])
    for cut in range(1, len(text)):
        assert run(make_parser(), [text[:cut], text[cut:]]) == whole, f"split at {cut}: {text[:cut]!r}"
    assert run(make_parser(), list(text)) == whole
    return whole
