"""Chat templates within limits (loading/chat_template.py): a template from a crafted model file cannot take the
process's memory or time, whatever it asks. Past a limit on a short probe conversation it fails the load with one
line; past one on a request, it is that request's error (a 400: tests/server/test_chat_template_limits.py). Real
templates render as they did (test_tokenizer.py and the server's format tests compare them with transformers and
openai-harmony), and long agent conversations stay well within every limit."""
import time
import tracemalloc

import pytest

from fastdecode.errors import InvalidRequestError, ModelFileError
from fastdecode.loading.chat_template import ChatTemplate, TemplateLimitError, TemplateLimits
from fastdecode.loading.tokenizer import CHATML_TEMPLATE, Tokenizer
from tests.helpers.chat_models import TEMPLATES
from tests.loading.test_tokenizer import tiny_gpt2

HUGE = "1500000000"  # the issue's factor (24 GB and the OOM killer, unchecked), written in templates as HUGE
LIMITS = TemplateLimits()


@pytest.fixture(scope="module")
def tiny():
    return Tokenizer.from_gguf(tiny_gpt2())


def refused_quickly_and_small(tokenizer, template: str, match: str = "limit", traced: bool = True):
    """Renders `template` for one message: it must fail as the request's error, within 10 s, having held no more
    than a few times the size limit at once (where `traced`: tracemalloc slows a render of many steps)."""
    tokenizer.chat_template = template.replace("HUGE", HUGE)
    if traced:
        tracemalloc.start()
    start = time.perf_counter()
    try:
        with pytest.raises(InvalidRequestError, match=match):
            tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert time.perf_counter() - start < 10
    assert peak < 4 * LIMITS.size + 2**24


def test_the_issues_huge_repetition_is_refused_before_it_is_made(tiny):
    refused_quickly_and_small(tiny, "{{ 'x' * HUGE }}", match="limit of 33554432 characters")


def test_the_issues_nested_range_loops_end_at_the_step_limit(tiny):
    refused_quickly_and_small(
        tiny, "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", match="steps",
        traced=False)


def test_output_past_the_size_limit_is_refused(tiny):
    refused_quickly_and_small(tiny, "{% for i in range(40000) %}{{ messages[0].content * 500 }}{% endfor %}")


@pytest.mark.parametrize("template", [
    "{{ HUGE * 'x' }}",
    "{{ ['x'] * HUGE }}",
    "{{ 'x' | center(HUGE) }}",  # a width
    "{{ 'x'.ljust(HUGE) }}",
    "{{ '%HUGEs' % 'x' }}",  # a width in a format string
    "{{ '%*s' % (HUGE, 'x') }}",  # ... or taken from its values
    "{{ '{:>HUGE}'.format('x') }}",
    "{{ '{:>{w}}'.format('x', w=HUGE) }}",
    "{{ 2 ** 10000000000 }}",  # a huge integer
    "{{ ('x' * 100000).join(['a'] * 100000) }}",  # a long separator many times
    "{{ (['a'] * 100000) | join('x' * 100000) }}",
    "{{ ('x' * 100000).replace('x', 'y' * 100000) }}",
    "{{ ('x' * 100000) | replace('x', 'y' * 100000) }}",
    "{{ ('\\t' * 100000).expandtabs(100000) }}",
    "{{ ('x\\n' * 100000) | indent(100000) }}",
    "{{ ('x\\n' * 100000) | indent('x' * 100000) }}",
    "{{ ('x ' * 100000) | wordwrap(1, wrapstring='y' * 100000) }}",
    "{{ ('x' * 100000).translate({120: 'y' * 100000}) }}",
    "{{ [1] | batch(HUGE, 0) | list }}",
    "{{ [1] | slice(HUGE) | list }}",
    "{{ [1] | tojson(indent=HUGE) }}",
    # doubling, a step at a time: with ~, with +, through a {% set %} block and through a macro
    "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set t %}{{ ns.s }}{{ ns.s }}{% endset %}"
    "{% set ns.s = t %}{% endfor %}",
    "{% macro twice(s) %}{{ s }}{{ s }}{% endmacro %}{% set ns = namespace(s='x') %}{% for i in range(64) %}"
    "{% set ns.s = twice(ns.s) %}{% endfor %}",
    # a list holding itself twice, 64 times over: 2^64 strings to print, compare or hash, in a few steps
    "{% set ns = namespace(l=['x']) %}{% for i in range(64) %}{% set ns.l = [ns.l, ns.l] %}{% endfor %}{{ ns.l }}",
    "{% set ns = namespace(a=[1], b=[1]) %}{% for i in range(64) %}{% set ns.a = [ns.a, ns.a] %}"
    "{% set ns.b = [ns.b, ns.b] %}{% endfor %}{{ ns.a == ns.b }}",
    "{% set d = {'a': 'x' * 100000} %}{{ [d.items()] * 10000 }}",  # a dict's view is as big as the dict
    "{% set ns = namespace(x=1) %}{% for i in range(300) %}{% set ns.x = [ns.x] %}{% endfor %}"
    "{{ ns.x | tojson(indent=1000000) }}",  # an indent repeated at every depth of every line
])
def test_operations_that_multiply_their_input_are_refused(tiny, template):
    refused_quickly_and_small(tiny, template)


@pytest.mark.parametrize("template", [
    "{% set r = range(100000) %}{% for i in r %}{% for j in r if j < 0 %}{% endfor %}{% endfor %}",  # all filtered out
    "{% set r = range(1000) | list %}{% for x in r recursive %}{% if loop.depth < 5 %}{{ loop(r) }}{% endif %}"
    "{% endfor %}",  # a recursive loop's levels
    "{% for m in messages %}{% for n in messages %}{% endfor %}{% endfor %}",
])
def test_every_loop_iteration_is_a_step(template):
    with pytest.raises(TemplateLimitError, match="steps"):
        ChatTemplate(template, TemplateLimits(steps=1000)).render(messages=[{}] * 100)


def test_a_render_stops_at_its_time_limit():
    template = ChatTemplate("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                            TemplateLimits(steps=1 << 62, seconds=0.2))
    start = time.perf_counter()
    with pytest.raises(TemplateLimitError, match="0.2 s"):
        template.render()
    assert time.perf_counter() - start < 1


@pytest.mark.parametrize("template", [
    "{% set ns = namespace(inner=namespace()) %}",  # a namespace may grow after it is put somewhere
    "{% set ns = namespace() %}{% set l = [ns] %}",
    "{% set ns = namespace() %}{% set ns.self = ns %}",
])
def test_a_namespace_is_held_by_no_list_dict_or_namespace(tiny, template):
    refused_quickly_and_small(tiny, template, match="namespace")


def test_a_template_past_a_limit_on_the_probe_conversation_fails_the_load():
    for template in ("{{ 'x' * HUGE }}", "{% if tools %}{{ 'x' * HUGE }}{% endif %}"):
        with pytest.raises(ModelFileError, match="chat template went past its limit") as info:
            Tokenizer.from_gguf({**tiny_gpt2(), "tokenizer.chat_template": template.replace("HUGE", HUGE)})
        assert "\n" not in str(info.value)


def test_a_template_past_a_limit_in_a_model_directory_fails_the_load(tiny, tmp_path):
    tiny.backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}{{ 'x' * " + HUGE + " }}{% endfor %}")
    with pytest.raises(ModelFileError, match="chat template went past its limit"):
        Tokenizer.from_hf_dir(tmp_path)


def test_a_template_that_refuses_the_probe_conversation_still_loads():
    """Its other errors are the requests' to meet (a template without a tool role, say), as before."""
    template = "{% if tools %}{{ raise_exception('no tools here') }}{% endif %}{{ messages[0].content }}"
    tokenizer = Tokenizer.from_gguf({**tiny_gpt2(), "tokenizer.chat_template": template})
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi"
    with pytest.raises(InvalidRequestError, match="no tools here"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=[{"type": "function"}])


def agent_conversation(n: int) -> tuple[list[dict], list[dict]]:
    """(n messages, 20 tools) of an agent's session: a long system prompt, then user turns, tool calls with their
    results of 2,000 characters, and answers."""
    def schema(i):
        return {"type": "object", "required": ["p0"], "properties": {
            f"p{j}": {"type": ["string", "integer", "boolean"][j % 3], "description": f"parameter {j} of {i} " * 5}
            for j in range(8)}}
    tools = [{"type": "function", "function": {"name": f"tool_{i}", "description": f"Tool {i}. " * 20,
                                               "parameters": schema(i)}} for i in range(20)]
    messages = [{"role": "system", "content": "You are an agent. " * 1000}]
    while len(messages) < n:
        k = len(messages)
        messages += [{"role": "user", "content": f"request {k} " + "u" * 2000},
                     {"role": "assistant", "content": "", "tool_calls": [{"id": f"c{k}", "type": "function",
                      "function": {"name": "tool_1", "arguments": {"p0": "x" * 100}}}]},
                     {"role": "tool", "tool_call_id": f"c{k}", "name": "tool_1", "content": "r" * 2000},
                     {"role": "assistant", "content": "done " + "a" * 200}]
    return messages[:n], tools


@pytest.mark.parametrize("name", [*TEMPLATES, "chatml"])
def test_real_templates_render_a_long_agent_session_within_a_quarter_of_each_limit(name):
    """1,000 messages and 20 tools: gpt-oss's template (harmony), which looks ahead from each call, takes 131k steps
    and makes 2.6 times its 1.2M-character output; the others far less."""
    messages, tools = agent_conversation(1000)
    quarter = TemplateLimits(LIMITS.size // 4, LIMITS.steps // 4, LIMITS.seconds / 4)
    source = CHATML_TEMPLATE if name == "chatml" else TEMPLATES[name]
    if name == "mistral":  # its template wants call ids of nine letters and digits
        for m in messages:
            for call in m.get("tool_calls", []):
                call["id"] = f"{call['id']:a>9}"[-9:]
    text = ChatTemplate(source, quarter).render(messages=messages, tools=tools, add_generation_prompt=True)
    assert len(text) > 1_000_000
