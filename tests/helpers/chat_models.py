"""Tiny random chat models whose chat templates teach one reply format each, for the server's format tests.

Each is a 2-layer Llama with a byte-level vocabulary (every byte one token, no merges) plus the added tokens of
the formats: special ones as in the real vocabularies (`<|im_end|>`, Mistral's `[TOOL_CALLS]`, `[ARGS]`...) and
plain added ones (`<think>`, `<tool_call>`, as in Qwen's). The templates are cut-down copies of the real ones that
render the same markers: the server chooses a format from them, as it would from the real ones.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
import transformers
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from tests.helpers.checkpoints import scratch_dir

SPECIAL = ["<|im_start|>", "<|im_end|>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]",
           "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "<|User|>", "<|Assistant|>",
           "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]
ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
EOS = "<|im_end|>"  # every model's but harmony's, which ends its reply with <|return|> (or <|call|>)

CHATML_TURNS = """
{%- for message in messages %}
{%- if message.role == "assistant" %}
<|im_start|>assistant
{{ (message.content | default("", true)).split("</think>")[-1] }}
{%- for call in message.tool_calls | default([]) %}
{{ CALL(call) }}
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}
<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}
<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
"""

# Qwen3: tools as JSON in <tools>, Hermes calls, reasoning in <think> (left out of earlier turns); with
# enable_thinking false, an empty reasoning block ends the prompt.
QWEN3 = """{%- macro CALL(call) %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>{% endmacro %}
{%- if tools %}
<|im_start|>system
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
For each function call, return a json object within <tool_call></tool_call> XML tags.<|im_end|>
{% endif %}""" + CHATML_TURNS + """
{%- if add_generation_prompt %}
<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}
{%- endif %}"""

# Qwen3-Coder: XML calls, each value on its own lines.
QWEN3_CODER = """{%- macro CALL(call) %}<tool_call>
<function={{ call.function.name }}>
{% for name, value in call.function.arguments.items() %}
<parameter={{ name }}>
{{ value if value is string else value | tojson }}
</parameter>
{% endfor %}
</function>
</tool_call>{% endmacro %}
{%- if tools %}
<|im_start|>system
<tools>
{%- for tool in tools %}
<function><name>{{ tool.function.name }}</name></function>
{%- endfor %}
</tools>
Call a function as <tool_call>
<function=NAME>
<parameter=NAME>
value
</parameter>
</function>
</tool_call><|im_end|>
{% endif %}""" + CHATML_TURNS + """
{%- if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""

# DeepSeek-R1: the generation prompt opens <think>, so the reply starts inside it.
DEEPSEEK_R1 = """
{%- for message in messages %}
{%- if message.role == "assistant" %}<|Assistant|>{{ message.content.split("</think>")[-1] }}<|im_end|>
{%- else %}<|User|>{{ message.content }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|Assistant|><think>
{% endif %}"""

# Mistral Small 3.2 / Magistral: [TOOL_CALLS]NAME[CALL_ID]ID[ARGS]{json}; ids of exactly 9 letters or digits.
MISTRAL = """
{%- for message in messages %}
{%- if message.role == "user" or message.role == "system" %}
{%- if tools and loop.first %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}
[INST]{{ message.content }}[/INST]
{%- elif message.role == "assistant" %}
{{- message.content | default("", true) }}
{%- for call in message.tool_calls | default([]) %}
{%- if call.id | length != 9 %}{{ raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
{%- endif %}
[TOOL_CALLS]{{ call.function.name }}[CALL_ID]{{ call.id }}[ARGS]{{ call.function.arguments | tojson }}
{%- endfor %}<|im_end|>
{%- elif message.role == "tool" %}[TOOL_RESULTS]{{ message.tool_call_id }} {{ message.content }}[/TOOL_RESULTS]
{%- endif %}
{%- endfor %}"""

# gpt-oss (harmony), cut down from its template: the system message with the reasoning level, the developer message
# with the instructions and the tools as a TypeScript namespace (strings, enums, numbers, booleans and arrays of them),
# reasoning kept only for a call no final answer has followed yet. Where gpt-oss's template and openai-harmony differ,
# this follows openai-harmony: a tool's result goes in as written (gpt-oss's `tojson` quotes it as a JSON string) and
# a call's arguments as `<|constrain|>json` (gpt-oss's write plain `json`, which the library renders too).
HARMONY = """{%- macro TYPE(spec) %}
{%- if spec.type == "string" and spec.enum %}"{{ spec.enum | join('" | "') }}"
{%- elif spec.type in ("integer", "number") %}number
{%- elif spec.type in ("string", "boolean") %}{{ spec.type }}
{%- elif spec.type == "array" and spec["items"] %}{{ TYPE(spec["items"]) }}[]
{%- else %}any{% endif %}
{%- endmacro %}
{%- set reasoning_effort = reasoning_effort | default("medium", true) %}
{{- "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\nKnowledge cutoff: 2024-06\n"
    + "Current date: " + strftime_now("%Y-%m-%d") + "\n\nReasoning: " + reasoning_effort + "\n\n"
    + "# Valid channels: analysis, commentary, final. Channel must be included for every message." }}
{%- if tools %}{{ "\nCalls to these tools must go to the commentary channel: 'functions'." }}{% endif %}
{{- "<|end|>" }}
{%- set loop_messages = messages %}
{%- if messages[0].role in ("system", "developer") %}
{%- set loop_messages = messages[1:] %}
{%- endif %}
{%- if loop_messages is not sameas messages or tools %}
{{- "<|start|>developer<|message|>" }}
{%- if loop_messages is not sameas messages %}{{ "# Instructions\n\n" + messages[0].content + "\n\n" }}{% endif %}
{%- if tools %}
{{- "# Tools\n\n## functions\n\nnamespace functions {\n\n" }}
{%- for tool in tools %}
{%- set f = tool.function %}
{{- "// " + f.description + "\ntype " + f.name + " = " }}
{%- if f.parameters and f.parameters.properties %}
{{- "(_: {\n" }}
{%- for name, spec in f.parameters.properties.items() %}
{%- if spec.description %}{{ "// " + spec.description + "\n" }}{% endif %}
{{- name + ("" if name in (f.parameters.required or []) else "?") + ": " + TYPE(spec) + ",\n" }}
{%- endfor %}
{{- "}) => any;\n\n" }}
{%- else %}{{ "() => any;\n\n" }}{% endif %}
{%- endfor %}
{{- "} // namespace functions" }}
{%- endif %}
{{- "<|end|>" }}
{%- endif %}
{%- set last_call = namespace(name=none) %}
{%- for message in loop_messages %}
{%- if message.role == "assistant" and message.tool_calls %}
{%- set later = namespace(final=false) %}
{%- for future in loop_messages[loop.index:] %}
{%- if future.role == "assistant" and not future.tool_calls %}{% set later.final = true %}{% endif %}
{%- endfor %}
{%- if message.content and message.thinking %}
{{- raise_exception("Cannot pass both content and thinking in an assistant message with tool calls!") }}
{%- endif %}
{%- set reasoning = message.thinking or message.content %}
{%- if reasoning and not later.final %}
{{- "<|start|>assistant<|channel|>analysis<|message|>" + reasoning + "<|end|>" }}
{%- endif %}
{%- set call = message.tool_calls[0].function %}
{{- "<|start|>assistant to=functions." + call.name + "<|channel|>commentary <|constrain|>json<|message|>" }}
{{- call.arguments | tojson + "<|call|>" }}
{%- set last_call.name = call.name %}
{%- elif message.role == "assistant" %}
{{- "<|start|>assistant<|channel|>final<|message|>" + message.content + "<|end|>" }}
{%- elif message.role == "tool" %}
{%- if last_call.name is none %}{{ raise_exception("a tool result with no call before it") }}{% endif %}
{{- "<|start|>functions." + last_call.name + " to=assistant<|channel|>commentary<|message|>" + message.content }}
{{- "<|end|>" }}
{%- else %}
{{- "<|start|>" + message.role + "<|message|>" + message.content + "<|end|>" }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start|>assistant{% endif %}"""

TEMPLATES = {"qwen3": QWEN3, "qwen3_coder": QWEN3_CODER, "deepseek_r1": DEEPSEEK_R1, "mistral": MISTRAL,
             "harmony": HARMONY}


def byte_tokenizer() -> Tokenizer:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED])
    return tokenizer


@functools.cache
def chat_model(name: str) -> Path:
    """A directory holding the tiny model with TEMPLATES[name] as its chat template."""
    path = scratch_dir() / f"chat-{name}"
    tokenizer = byte_tokenizer()
    eos_token = "<|return|>" if name == "harmony" else EOS
    eos = tokenizer.token_to_id(eos_token)
    config = transformers.LlamaConfig(vocab_size=tokenizer.get_vocab_size(), hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      max_position_embeddings=4096, eos_token_id=eos, bos_token_id=None)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos_token, "chat_template": TEMPLATES[name]}))
    return path
