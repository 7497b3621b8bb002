"""Bundled coding-agent workloads load with the right categories; a bad user file names its line."""
import json

import pytest

from fastdecode.errors import InvalidRequestError
from fastdecode.workloads import CATEGORIES, DATA_DIR, WorkItem, load_workload

MIN_ITEMS = {"code_edit": 8, "refactor": 6, "boilerplate": 6, "explanation": 6, "low_overlap": 6}


@pytest.mark.parametrize("category", CATEGORIES)
def test_each_bundled_category_loads_with_its_own_category(category):
    items = load_workload(category)
    assert len(items) >= MIN_ITEMS[category]
    assert all(isinstance(i, WorkItem) and i.category == category for i in items)
    assert all(i.messages[0]["role"] == "system" and i.messages[-1]["role"] == "user" for i in items)


def test_coding_agent_is_every_category_with_unique_ids():
    items = load_workload("coding-agent")
    assert {i.category for i in items} == set(CATEGORIES)
    assert len({i.id for i in items}) == len(items)
    assert sorted(p.stem for p in DATA_DIR.glob("*.jsonl")) == sorted(CATEGORIES)


def test_code_edit_prompts_carry_a_whole_file_and_a_small_change():
    for item in load_workload("code_edit"):
        user = item.messages[-1]["content"]
        code = user.split("```")[1]
        assert 30 <= code.count("\n") <= 90, item.id
        assert "return the whole file with this small change" in user.lower()
        assert 256 <= item.max_tokens <= 512


def write(tmp_path, lines):
    path = tmp_path / "mine.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


GOOD = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "category": "chat"})


def test_user_file_loads_and_gets_ids_from_line_numbers(tmp_path):
    path = write(tmp_path, [GOOD, "", json.dumps({**json.loads(GOOD), "id": "named"})])
    items = load_workload(path)
    assert [i.id for i in items] == ["mine-1", "named"]
    assert items[0] == WorkItem([{"role": "user", "content": "hi"}], 8, "chat", "mine-1")
    assert load_workload(str(path))[1].id == "named"  # a str path works too


@pytest.mark.parametrize("bad, says", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    (json.dumps({"messages": [], "max_tokens": 8, "category": "x"}), "non-empty list"),
    (json.dumps({"messages": [{"role": "user"}], "max_tokens": 8, "category": "x"}), "messages[0]"),
    (json.dumps({"messages": [{"role": "user", "content": "a"}], "max_tokens": 0, "category": "x"}), "max_tokens"),
    (json.dumps({"messages": [{"role": "user", "content": "a"}], "max_tokens": 8}), "missing 'category'"),
])
def test_bad_line_is_a_clear_error_naming_file_and_line(tmp_path, bad, says):
    path = write(tmp_path, [GOOD, bad])
    with pytest.raises(InvalidRequestError) as e:
        load_workload(path)
    assert f"{path}:2" in str(e.value) and says in str(e.value)


def test_duplicate_ids_empty_files_and_unknown_names_are_errors(tmp_path):
    dup = json.dumps({**json.loads(GOOD), "id": "a"})
    with pytest.raises(InvalidRequestError, match="duplicate id 'a'"):
        load_workload(write(tmp_path, [dup, dup]))
    with pytest.raises(InvalidRequestError, match="no work items"):
        load_workload(write(tmp_path, [""]))
    with pytest.raises(InvalidRequestError, match="not a bundled name"):
        load_workload("no-such-workload")
