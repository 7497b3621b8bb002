"""Chat templates: compiled in the sandbox transformers renders them in, and rendered within limits, because a template
comes in the model file and is code that nobody has read.

Each render has a budget (TemplateLimits): a size, charged with every string, list or dict that an operator, call,
filter, literal or block makes and with the output; steps (loop iterations, calls, filters, operators, literals);
and seconds. What an operation makes is charged when it returns, so a render goes past its size by one operation's
worth at most; the operations that can multiply their input in one call (`'x' * n`, `center(n)`, `sep.join(items)`,
`replace`, format widths) are weighed before they run. A list or dict counts its contents, which stay within the
size, so no comparison, hash or printing of one can run away; and none may hold a namespace, which could later grow
it unseen.
"""
from __future__ import annotations

import functools
import itertools
import json
import re
import time
import types
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime

from jinja2 import nodes
from jinja2.compiler import CodeGenerator
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.ext import loopcontrols
from jinja2.runtime import LoopContext, Macro
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace


@dataclass(frozen=True)
class TemplateLimits:
    # What one render may make, output included, in characters (a list or dict counts 64 and 8 an item, about its
    # bytes): real templates make 1-4 times their output, and 2^25 characters is 8M tokens of prompt or more.
    size: int = 1 << 25
    # Loop iterations, calls, filters, operators and literals: real templates take a few per message and tool, but
    # gpt-oss's looks ahead from each message with a tool call (1.1M steps for 3,000 messages, 1.5 s unbounded).
    steps: int = 1 << 21
    # A backstop for what is slow but makes little (sorting, comparing); checked at every step.
    seconds: float = 5.0


class TemplateLimitError(SecurityError):
    """A render that went past its TemplateLimits."""


CONTAINERS = (list, tuple, dict, set, frozenset)
MAPPINGS = (dict, types.MappingProxyType)  # a dict view's `mapping` is a proxy of its dict
DICT_VIEWS = (type({}.keys()), type({}.values()), type({}.items()))
# Operations (str methods, and filters) whose result can be many times the size of what they are given.
AMPLIFIERS = {"center", "ljust", "rjust", "zfill", "expandtabs", "replace", "indent", "wordwrap", "translate", "join",
              "format", "format_map", "batch", "slice", "tojson"}
# The budget of the render running in this thread; every hook below charges it.
ACTIVE: ContextVar[RenderBudget] = ContextVar("chat template render budget")

# What Tokenizer.check_chat_template renders at load: a plain conversation (which a template strict about roles takes),
# and one with a tool call and its result, with tools.
PROBE_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "Its name."}},
                   "required": ["city"]}}}]
PROBES = [
    ([{"role": "system", "content": "You are a helpful assistant."},
      {"role": "user", "content": "Hello!"},
      {"role": "assistant", "content": "Hello. How can I help?"},
      {"role": "user", "content": "What is the weather in Paris?"}], None),
    ([{"role": "system", "content": "You are a helpful assistant."},
      {"role": "user", "content": "What is the weather in Paris?"},
      {"role": "assistant", "content": "", "tool_calls": [{"id": "call_0", "type": "function", "function": {
          "name": "get_weather", "arguments": {"city": "Paris"}}}]},
      {"role": "tool", "tool_call_id": "call_0", "name": "get_weather", "content": "Sunny, 24 C."},
      {"role": "assistant", "content": "It is sunny in Paris, 24 C."},
      {"role": "user", "content": "Thanks!"}], PROBE_TOOLS),
]


class ChatTemplate:
    """A chat template compiled once and rendered within `limits` each time (compiling folds constant filters, so it
    runs within them too)."""

    def __init__(self, source: str, limits: TemplateLimits = TemplateLimits()):
        self.limits = limits
        with budget(limits):
            self.template = BoundedSandbox().from_string(source)

    def render(self, **variables) -> str:
        with budget(self.limits) as spent:
            return spent.joined(self.template.generate(variables))


@contextmanager
def budget(limits: TemplateLimits):
    token = ACTIVE.set(RenderBudget(limits))
    try:
        yield ACTIVE.get()
    finally:
        ACTIVE.reset(token)


class RenderBudget:
    """What one render has used of its limits."""

    def __init__(self, limits: TemplateLimits):
        self.limits = limits
        self.steps = self.size = 0
        self.deadline = time.monotonic() + limits.seconds
        self.sizes = {}  # id -> (container, size_of it), the container kept so that no other object takes its id

    def step(self):
        self.steps += 1
        if self.steps > self.limits.steps:
            raise TemplateLimitError(f"went past its limit of {self.limits.steps} steps (loop iterations, calls, "
                                     "filters and operators)")
        if time.monotonic() > self.deadline:
            raise TemplateLimitError(f"went past its limit of {self.limits.seconds:g} s")

    def expect(self, size: int):
        """Refuses an operation that may make `size` more, before it runs."""
        if self.size + size > self.limits.size:
            raise TemplateLimitError(f"went past its limit of {self.limits.size} characters made")

    def charge(self, size: int):
        self.expect(size)
        self.size += size

    def made(self, value, *inputs):
        """`value`, which an operation made from `inputs`: charged unless it is one of them (passed through), and a
        container with its contents checked (size_of)."""
        if not any(value is x for x in inputs):
            self.charge(made_size(value))
            if isinstance(value, CONTAINERS):
                self.size_of(value)
        return value

    def size_of(self, value) -> int:
        """`value`'s characters with its contents' (64 a container and 8 an item besides), as printing, comparing or
        hashing it walks them; over the limit, or a namespace (which could change after), is refused. The immutable
        sandbox keeps a container from changing, so its size is worked out once."""
        if isinstance(value, str):
            return len(value)
        if isinstance(value, Namespace):
            raise TemplateLimitError("put a namespace in a list, dict or namespace, which the sandbox refuses")
        if isinstance(value, DICT_VIEWS):
            return self.size_of(value.mapping)
        if not isinstance(value, (*CONTAINERS, *MAPPINGS)):
            return 8
        known = self.sizes.get(id(value))
        if known is not None:
            return known[1]
        items = itertools.chain.from_iterable(value.items()) if isinstance(value, MAPPINGS) else value
        size = 64 + sum(8 + self.size_of(item) for item in items)
        if size > self.limits.size:
            raise TemplateLimitError(f"went past its limit of {self.limits.size} characters in one value")
        self.sizes[id(value)] = (value, size)
        return size

    def joined(self, pieces) -> str:
        """The pieces' text joined (jinja's str_join and concat), charged piece by piece."""
        out = []
        for piece in pieces:
            piece = str(piece)
            self.charge(len(piece))
            out.append(piece)
        return "".join(out)


def made_size(value) -> int:
    """What making `value` took: its characters, a list's or dict's 64 and 8 an item, or an integer's bytes."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, CONTAINERS):
        return 64 + 8 * len(value)
    if isinstance(value, int):
        return value.bit_length() // 8
    return 0


def binop_size(operator: str, left, right, size_of) -> int:
    """What `left operator right` may make, known before it runs; 0 where its inputs bound it (+, and - / //)."""
    if operator == "*":
        if isinstance(right, (str, list, tuple)):
            left, right = right, left
        if isinstance(left, (str, list, tuple)) and isinstance(right, int):
            return size_of(left) * max(right, 0)
        if isinstance(left, int) and isinstance(right, int):
            return (left.bit_length() + right.bit_length()) // 8
    if operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
        return left.bit_length() * right // 8
    if operator == "%" and isinstance(left, str):
        return format_size(left, list(right) if isinstance(right, tuple) else [right], size_of)
    return 0


def amplified_size(name: str, subject, args, kwargs, size_of) -> int:
    """What string operation `name` (a str method of `subject`, or the filter of that name on it) may make, known
    before it runs. `join` takes the separator as its subject and the items as its one argument."""
    def arg(i, key, default):
        return args[i] if len(args) > i else kwargs.get(key, default)

    def number(v):
        return v if isinstance(v, int) else 0

    if name in ("batch", "slice"):  # lists of (at most) this many items, or this many lists
        return 72 * number(arg(0, "linecount" if name == "batch" else "slices", 0))
    if name == "tojson":  # the indent, made before anything is written (the rest is charged as it is)
        indent = arg(1, "indent", None)
        return len(indent) if isinstance(indent, str) else number(indent)
    text = subject if isinstance(subject, str) else str(subject)
    if name == "join":
        items = args[0]
        return len(text) * len(items) + sum(size_of(item) for item in items)
    if name in ("center", "ljust", "rjust", "zfill"):
        return max(len(text), number(arg(0, "width", 80)))
    if name == "expandtabs":
        return len(text) + text.count("\t") * number(arg(0, "tabsize", 8))
    if name == "replace":
        old, new = str(arg(0, "old", "")), str(arg(1, "new", ""))
        return len(text) + text.count(old) * max(len(new) - len(old), 0)
    if name == "indent":
        width = arg(0, "width", 4)
        return len(text) + (text.count("\n") + 1) * (len(width) if isinstance(width, str) else number(width))
    if name == "wordwrap":
        return (len(text) + 1) * (1 + len(str(arg(2, "wrapstring", None) or "\n")))
    if name == "translate":
        table = arg(0, "table", {})
        values = [v for v in table.values() if isinstance(v, str)] if isinstance(table, dict) else []
        return len(text) * max(map(len, values), default=1)
    if name in ("format", "format_map"):
        return format_size(text, [*args, *kwargs.values()], size_of)
    return 0


def format_size(fmt: str, values, size_of) -> int:
    """What str.format or % may make of `fmt`: each field the largest value, widened to the largest number written in
    `fmt` (or passed, where a width can come from the values: `%*d`, `{:{w}}`)."""
    fields = fmt.count("{") + fmt.count("%")
    numbers = [int(d) if len(d) < 19 else 10**19 for d in re.findall(r"\d+", fmt)]
    if "*" in fmt or re.search(r"{[^{}]*{", fmt):
        numbers += [v for v in values if isinstance(v, int)]
    largest = max((size_of(v) for v in values), default=0)
    return len(fmt) + fields * (largest + max(numbers, default=0))


def bounded_filter(name: str, f):
    """Filter `f`, a step and charged for what it makes; weighed first where it can multiply its input."""
    first = 1 if getattr(f, "jinja_pass_arg", None) else 0  # where the context, eval context or environment goes

    @functools.wraps(f)
    def bounded(*args, **kwargs):
        spent = ACTIVE.get()
        spent.step()
        value, rest = args[first], args[first + 1:]
        if name == "join":
            value = list(value)
            args = (*args[:first], value, *rest)
            spent.expect(amplified_size(name, rest[0] if rest else kwargs.get("d", ""), [value], {}, spent.size_of))
        elif name in AMPLIFIERS:
            spent.expect(amplified_size(name, value, rest, kwargs, spent.size_of))
        return spent.made(f(*args, **kwargs), *args)
    return bounded


class BoundedCodeGenerator(CodeGenerator):
    """Routes through the environment what the sandbox's hooks do not see: each loop's items, `~`, and literal lists,
    tuples and dicts."""

    def visit_For(self, node, frame):
        node.iter = nodes.Call(nodes.EnvironmentAttribute("counted"), [node.iter], [], None, None, lineno=node.lineno)
        super().visit_For(node, frame)

    def visit_Concat(self, node, frame):
        self.write("environment.joined((")
        for piece in node.nodes:
            self.visit(piece, frame)
            self.write(", ")
        self.write("))")

    def literal(self, visit, node, frame):
        self.write("environment.literal(")
        visit(node, frame)
        self.write(")")

    def visit_List(self, node, frame):
        self.literal(super().visit_List, node, frame)

    def visit_Dict(self, node, frame):
        self.literal(super().visit_Dict, node, frame)

    def visit_Tuple(self, node, frame):
        if node.ctx == "load":  # not a target: `{% for a, b in ... %}`
            self.literal(super().visit_Tuple, node, frame)
        else:
            super().visit_Tuple(node, frame)


class BoundedNamespace(Namespace):
    """jinja's namespace, refusing a namespace (or a list or dict holding one) as a value."""

    def __init__(*args, **kwargs):  # Namespace's own signature: any keyword may be an attribute's name
        Namespace.__init__(*args, **kwargs)
        for value in args[0]._Namespace__attrs.values():
            ACTIVE.get().size_of(value)

    def __setitem__(self, name, value):
        ACTIVE.get().size_of(value)
        super().__setitem__(name, value)


def raise_exception(message):
    raise TemplateError(message)


def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    """transformers' tojson: plain json.dumps (jinja's own escapes HTML characters). Indented, its pieces are charged
    as they are written, since an indent repeats on every line at every depth."""
    encoder = json.JSONEncoder(ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    if indent is None:
        return encoder.encode(value)
    return ACTIVE.get().joined(encoder.iterencode(value))


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """The environment transformers renders chat templates in (sandboxed, trim/lstrip blocks, loop controls, its
    helpers), with every operation that makes something charged to the render's budget. lipsum is gone: random text
    has no place in a prompt, and its size is what its argument asks."""
    intercepted_binops = frozenset({"+", "*", "**", "%"})
    code_generator_class = BoundedCodeGenerator

    def __init__(self):
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        self.filters["tojson"] = tojson
        self.filters = {name: bounded_filter(name, f) for name, f in self.filters.items()}
        del self.globals["lipsum"]
        self.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt),
                            namespace=BoundedNamespace)

    def call_binop(self, context, operator, left, right):
        spent = ACTIVE.get()
        spent.step()
        spent.expect(binop_size(operator, left, right, spent.size_of))
        return spent.made(super().call_binop(context, operator, left, right), left, right)

    def call(self, context, obj, /, *args, **kwargs):
        spent = ACTIVE.get()
        spent.step()
        if isinstance(obj, LoopContext):  # a recursive loop's next level
            args = (self.counted(args[0]), *args[1:])
        method = getattr(obj, "__wrapped__", obj)  # the sandbox hands out str.format wrapped
        subject = getattr(method, "__self__", None)
        name = getattr(method, "__name__", "")
        if isinstance(subject, str) and name in AMPLIFIERS:
            if name == "join" and args:
                args = (list(args[0]), *args[1:])
            spent.expect(amplified_size(name, subject, args, kwargs, spent.size_of))
        result = super().call(context, obj, *args, **kwargs)
        if isinstance(obj, (Macro, LoopContext)) or isinstance(subject, dict):
            return result  # rendered through concat (charged there), or what the dict holds
        return spent.made(result, subject, *args, *kwargs.values())

    def counted(self, iterable):
        """A loop's items, each a step."""
        spent = ACTIVE.get()
        for item in iterable:
            spent.step()
            yield item

    def literal(self, value):
        spent = ACTIVE.get()
        spent.step()
        return spent.made(value)

    def joined(self, pieces) -> str:
        return ACTIVE.get().joined(pieces)

    concat = joined  # what jinja joins the output of a block, a macro or a `{% set %}` block with
