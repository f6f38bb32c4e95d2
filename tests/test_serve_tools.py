"""Tool calling in ``/v1/chat/completions``: the parsers alone, the chat template receiving tools and tool turns,
and the official ``openai`` client against real servers: the default model (xgrammar) and a tiny random-weight Qwen3
folder carrying a Qwen-style template (llguidance). A forced call (``required`` or named) always parses and its
arguments validate against the tool's schema; ``auto`` returns calls or plain content; a stream's tool-call deltas
reassemble to the non-streamed call."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from infer.registry import get_registry
from infer.serve.process import ServerProcess
from infer.serve.protocol import ChatCompletionRequest
from infer.serve.tools import select_tool_parser
from infer.tool_parser import ToolCall

API_KEY = "tools-key"
# Bounded arguments (enums, small integers, booleans): a random model under the grammar still ends the call within
# a few tokens, so every forced call completes.
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
ALARM = {
    "type": "function",
    "function": {
        "name": "set_alarm",
        "parameters": {
            "type": "object",
            "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 9}, "loud": {"type": "boolean"}},
            "required": ["hour", "loud"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, ALARM]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris for the next three days?"}]

# A Hermes/Qwen-style template: tools in the system turn, calls as <tool_call>{json}</tool_call>, tool results as
# <tool_response> in a user turn.
QWEN_STYLE_TEMPLATE = """
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

You are provided with function signatures within <tools></tools> XML tags:
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}
{%- elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{{ message.content or '' }}{% for call in message.tool_calls or [] %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}
"""


# -- the parsers -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def registry():
    return get_registry(None)


def test_hermes_reads_calls_and_the_content_around_them(registry):
    parser = registry.load("tool_parser", "hermes")()
    text = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
        '</tool_call>\n<tool_call>{"name": "set_alarm", "arguments": {"hour": 7, "loud": true}}</tool_call>'
    )
    parsed = parser.parse(text)
    assert parsed.tool_calls == [
        ToolCall("get_weather", '{"city": "Paris", "days": 3}'),
        ToolCall("set_alarm", '{"hour": 7, "loud": true}'),
    ]
    assert parsed.content.strip() == "Let me check."
    assert parser.parse("<tool_call>{not json</tool_call>").tool_calls == []  # a malformed call stays content
    assert parser.parse("just words").content == "just words"
    assert parser.content_end("Hello <tool") == len("Hello ")  # the tag may be starting: held back
    assert parser.content_end("Hello <b>") == len("Hello <b>")
    assert parser.content_end("Hi <tool_call>{") == len("Hi ")


def test_llama3_json_reads_a_bare_object_and_leaves_prose_alone(registry):
    parser = registry.load("tool_parser", "llama3_json")()
    parsed = parser.parse('{"name": "get_weather", "parameters": {"city": "Lima", "days": 1}}')
    assert parsed.content is None and parsed.tool_calls == [ToolCall("get_weather", '{"city": "Lima", "days": 1}')]
    two = parser.parse('<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x": 1}}')
    assert [call.name for call in two.tool_calls] == ["a", "b"]
    assert parser.parse("The answer is {x}.").tool_calls == []
    assert parser.content_end('  {"na') == 0 and parser.content_end("Sure") == 4


def test_auto_picks_the_parser_whose_format_the_template_uses(registry):
    assert type(select_tool_parser(registry, "auto", QWEN_STYLE_TEMPLATE)).__name__ == "HermesToolParser"
    llama = '{% if tools %}{"name": function name, "parameters": dictionary of argument name and its value}{% endif %}'
    assert type(select_tool_parser(registry, "auto", llama)).__name__ == "Llama3JsonToolParser"
    assert select_tool_parser(registry, "auto", "{{ messages[0].content }}") is None
    assert select_tool_parser(registry, "auto", None) is None
    assert type(select_tool_parser(registry, "llama3_json", QWEN_STYLE_TEMPLATE)).__name__ == "Llama3JsonToolParser"
    assert select_tool_parser(registry, "none", QWEN_STYLE_TEMPLATE) is None


# -- the template ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    from transformers import AutoTokenizer, Qwen3Config

    from infer.testing.model import TINY_FIELDS, save_tiny_model

    config = Qwen3Config(**{**TINY_FIELDS, "head_dim": 32, "tie_word_embeddings": True})
    folder = save_tiny_model("Qwen3ForCausalLM", config, tmp_path_factory.mktemp("qwen3"))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = QWEN_STYLE_TEMPLATE
    tokenizer.save_pretrained(folder)
    return str(folder)


CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'},
}
HISTORY = [
    *ASK,
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 24C"},
]


def test_tools_and_tool_turns_reach_the_chat_template(qwen_dir):
    from transformers import AutoTokenizer

    request = ChatCompletionRequest.model_validate({"messages": HISTORY, "tools": TOOLS})
    prompt = request.engine_prompts()[0]
    text = AutoTokenizer.from_pretrained(qwen_dir).apply_chat_template(
        prompt.messages, tools=prompt.tools, tokenize=False, add_generation_prompt=True
    )
    assert '"name": "set_alarm"' in text and "<tools>" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>' in text
    assert "<tool_response>\nSunny, 24C\n</tool_response>" in text


# -- servers -----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=["default", "qwen3"])
def client(request, tmp_path_factory):
    if request.param == "default":
        overrides = ["model.dtype=float32", "model.max_model_len=512", "cache.num_blocks=128", "guide.name=xgrammar"]
    else:
        overrides = [
            f"model.path={request.getfixturevalue('qwen_dir')}",
            "model.dtype=float32",
            "model.max_model_len=512",
            "cache.num_blocks=128",
            "guide.name=llguidance",
        ]
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    with ServerProcess("baseline", overrides, api_key=API_KEY, log_path=log_path) as server:
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def served(client) -> str:
    return client.models.list().data[0].id


def assert_valid_calls(message, names=tuple(SCHEMAS)) -> None:
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "set_alarm"}}])
@pytest.mark.parametrize("temperature", [0, 1.0])
def test_forced_calls_always_parse_and_match_the_schema(client, tool_choice, temperature):
    named = isinstance(tool_choice, dict)
    reply = client.chat.completions.create(
        model=served(client),
        messages=ASK,
        tools=TOOLS,
        tool_choice=tool_choice,
        max_tokens=80,
        temperature=temperature,
        seed=1,
        n=3,
    )
    for choice in reply.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert_valid_calls(choice.message, ("set_alarm",) if named else tuple(SCHEMAS))


def test_streamed_call_deltas_reassemble_to_the_same_call(client):
    body = dict(
        model=served(client),
        messages=ASK,
        tools=TOOLS,
        max_tokens=80,
        temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    whole = client.chat.completions.create(**body).choices[0].message.tool_calls[0]
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(**body, stream=True):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for piece in choice.delta.tool_calls or []:
                call = calls.setdefault(piece.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = piece.id or call["id"]
                call["name"] += (piece.function.name or "") if piece.function else ""
                call["arguments"] += (piece.function.arguments or "") if piece.function else ""
    assert finish == "tool_calls" and list(calls) == [0]
    assert (calls[0]["name"], calls[0]["arguments"]) == (whole.function.name, whole.function.arguments)
    assert calls[0]["id"].startswith("call_")


def test_auto_returns_calls_or_plain_content_and_streams_the_same(client):
    body = dict(model=served(client), messages=HISTORY, tools=TOOLS, max_tokens=24, temperature=0)
    whole = client.chat.completions.create(**body).choices[0]
    if whole.message.tool_calls:
        assert_valid_calls(whole.message)
    else:
        assert whole.message.content and whole.finish_reason in ("stop", "length")
    content = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in client.chat.completions.create(**body, stream=True)
        if chunk.choices
    )
    assert content == (whole.message.content or "")
    none = client.chat.completions.create(**body, tool_choice="none").choices[0]
    assert none.message.tool_calls is None and none.message.content


BAD_TOOL_BODIES = [
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    (
        {
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
            "tool_choice": "required",
        },
        "tools",
    ),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages"),
    (
        {
            "messages": [
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{oops"}}],
                }
            ]
        },
        "messages",
    ),
    ({"messages": [{"role": "user", "content": "hi", "tool_calls": []}]}, "messages"),
    ({"logit_bias": {"1": "x"}}, "logit_bias"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
]


@pytest.mark.parametrize(("extra", "param"), BAD_TOOL_BODIES)
def test_malformed_tool_requests_get_a_400_naming_the_field(client, extra, param):
    body = {"model": served(client), "messages": ASK, "max_tokens": 4, **extra}
    response = httpx.post(
        f"{client.base_url}chat/completions", json=body, timeout=60, headers={"Authorization": f"Bearer {API_KEY}"}
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.text
