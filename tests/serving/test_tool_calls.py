"""`mlxspec serve` speaking what assistants send: tools, structured output, and 400s for the rest.

The real `openai` client against a loopback server on a tiny random model whose chat template is
a Hermes/Qwen-style tool template (mlx-lm finds its ``json_tools`` format), the default model
having none. References: plain decoding (``mlxspec.generate``) of the same prompt with the same
grammar, the chat template rendered directly, ``jsonschema``.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
from tiny_models import make_tiny_model

openai = pytest.importorskip("openai", reason="the openai client is in the dev extra")
jsonschema = pytest.importorskip("jsonschema")

from mlxspec.chat_template import chat_prompt  # noqa: E402
from mlxspec.generate import stream_generate  # noqa: E402
from mlxspec.grammar import schema_processor  # noqa: E402
from mlxspec.load import load  # noqa: E402
from mlxspec.serving.engine import Engine  # noqa: E402
from mlxspec.serving.http import Server  # noqa: E402
from mlxspec.serving.openai_api import ApiError, Limits, parse_completion  # noqa: E402
from mlxspec.serving.tool_calls import ToolCallStream  # noqa: E402
from mlxspec.speculative import make_draft  # noqa: E402

TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:\n<tools>{% for t in tools %}\n{{ t | tojson }}"
    "{% endfor %}\n</tools>\nCall one as <tool_call>\n{\"name\": ..., \"arguments\": ...}\n"
    "</tool_call><|im_end|>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant"
    "{%- for tool_call in m.tool_calls %}{%- set tool_call = tool_call.function %}\n<tool_call>\n"
    "{\"name\": \"{{ tool_call.name }}\", \"arguments\": {{ tool_call.arguments | tojson }}}\n"
    "</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "maxLength": 12},
                          "unit": {"enum": ["C", "F"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now.",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
PICK = {"type": "function", "function": {"name": "get_weather"}}
ANSWER = {"type": "object", "additionalProperties": False, "required": ["answer", "sure"],
          "properties": {"answer": {"type": "string", "maxLength": 10}, "sure": {"type": "boolean"}}}


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("tools") / "tiny")
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = TOOL_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return load(str(path))


@pytest.fixture(scope="module")
def server(tool_model):
    model, tokenizer = tool_model
    engine = Engine(model, tokenizer, max_batch=4,
                    draft=make_draft(model, tokenizer, prompt_lookup=True))
    srv = Server(engine, model_id="tiny", port=0,
                 limits=Limits(max_tokens=256, max_context=2048)).start()
    yield srv
    srv.drain(timeout=5)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def _check_call(call):
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)


@pytest.mark.parametrize("stream", [False, True])
def test_tool_call_round_trip(tool_model, client, stream):
    model, tokenizer = tool_model
    kw = {"model": "tiny", "tools": TOOLS, "temperature": 0, "max_tokens": 120}
    if stream:
        chunks = list(client.chat.completions.create(messages=ASK, tool_choice=PICK, stream=True,
                                                     **kw))
        deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
        assert len(deltas) == 1 and deltas[0].index == 0
        call, reason = deltas[0], chunks[-1].choices[0].finish_reason
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == ""
    else:
        r = client.chat.completions.create(messages=ASK, tool_choice=PICK, **kw)
        (call,), reason = r.choices[0].message.tool_calls, r.choices[0].finish_reason
        assert not r.choices[0].message.content
    assert reason == "tool_calls"
    _check_call(call)

    # The call and its result go back; the answer is what plain decoding of that prompt gives.
    calls = [{"id": call.id, "type": "function",
              "function": {"name": call.function.name, "arguments": call.function.arguments}}]
    messages = ASK + [{"role": "assistant", "content": None, "tool_calls": calls},
                      {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'}]
    rendered = [*ASK, {"role": "assistant", "content": "", "tool_calls": [
        {**calls[0], "function": {"name": "get_weather",
                                  "arguments": json.loads(call.function.arguments)}}]},
                {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'}]
    prompt = chat_prompt(tokenizer, rendered, tools=TOOLS)
    assert tokenizer.decode(prompt).count("<tool_response>\n{\"temp\": 21}") == 1
    expected = "".join(r.text for r in stream_generate(model, tokenizer, prompt, max_tokens=12))
    r = client.chat.completions.create(messages=messages, **{**kw, "max_tokens": 12})
    assert r.usage.prompt_tokens == len(prompt)
    assert r.choices[0].message.content == expected and r.choices[0].finish_reason in ("stop",
                                                                                     "length")


def test_required_tool_choice_calls_some_tool(client):
    r = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=160,
                                       tool_choice="required", parallel_tool_calls=False)
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    assert calls[0].function.name in ("get_weather", "get_time")
    assert isinstance(json.loads(calls[0].function.arguments), dict)


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_answer_validates_and_equals_plain_greedy(tool_model, server, client, stream):
    model, tokenizer = tool_model
    prompt = chat_prompt(tokenizer, ASK)
    responses = stream_generate(model, tokenizer, prompt, max_tokens=100,
                                logits_processors=[schema_processor(tokenizer, ANSWER)])
    expected = "".join(r.text for r in responses)
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER,
                                                  "strict": True}}
    engine = server.engine_thread.engine
    engine.solo_rate.seconds = None
    r = client.chat.completions.create(model="tiny", messages=ASK, response_format=fmt,
                                       max_tokens=100, temperature=0, stream=stream)
    text = ("".join(c.choices[0].delta.content or "" for c in r) if stream
            else r.choices[0].message.content)
    assert text == expected
    jsonschema.validate(json.loads(text), ANSWER)
    assert engine.solo_rate.seconds is not None  # the lone stream decoded speculatively


def test_concurrent_schema_answers_are_batched_and_equal_plain_greedy(tool_model, server,
                                                                     client):
    model, tokenizer = tool_model
    questions = [[{"role": "user", "content": f"Question {i}?"}] for i in range(3)]
    expected = []
    for messages in questions:
        responses = stream_generate(model, tokenizer, chat_prompt(tokenizer, messages),
                                    max_tokens=100,
                                    logits_processors=[schema_processor(tokenizer, ANSWER)])
        expected.append("".join(r.text for r in responses))
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}
    engine = server.engine_thread.engine
    engine.peak_streams = 0

    def ask(messages):
        return client.chat.completions.create(model="tiny", messages=messages, max_tokens=100,
                                              response_format=fmt).choices[0].message.content

    with ThreadPoolExecutor(3) as pool:
        assert list(pool.map(ask, questions)) == expected
    assert engine.peak_streams > 1  # decoded together, one grammar per row


def test_tool_calls_are_split_from_text_however_it_arrives(tool_model):
    _, tokenizer = tool_model
    text = 'Sure. <tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call> ok'
    for size in (1, 3, len(text)):
        stream = ToolCallStream(tokenizer, TOOLS, streaming=True)
        parts = [stream.feed(text[i : i + size]) for i in range(0, len(text), size)]
        parts.append(stream.finish())
        assert "".join(p[0] for p in parts) == "Sure.  ok"
        (call,) = [c for p in parts for c in p[1]]
        assert call["function"] == {"name": "get_time", "arguments": '{"tz": "UTC"}'}
    cut = ToolCallStream(tokenizer, TOOLS, streaming=False)  # cut off by max_tokens: kept as text
    assert cut.feed('<tool_call>\n{"name": "get_') == ("", [])
    assert cut.finish() == ('<tool_call>\n{"name": "get_', [])


@pytest.mark.parametrize("body, param", [
    ({"foo": 1}, "foo"),
    ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "hi", "audio": {}}]}, "messages[0].audio"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"$ref": "#/nowhere"}}}}, "response_format"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
])
def test_unsupported_fields_are_refused_by_name(client, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=ASK, max_tokens=4, extra_body=body)
    assert e.value.status_code == 400 and e.value.body["param"] == param


def test_tools_on_a_model_without_tool_support_are_refused(smollm2):
    _, tokenizer = smollm2  # SmolLM2-135M-Instruct: its template takes no tools
    body = {"messages": ASK, "tools": TOOLS}
    with pytest.raises(ApiError, match="no tool support") as e:
        parse_completion(body, "chat", tokenizer, Limits(), "smollm2")
    assert e.value.status == 400 and e.value.param == "tools"
    tool_result = {"messages": ASK + [{"role": "tool", "tool_call_id": "a", "content": "1"}]}
    with pytest.raises(ApiError, match="no tool support"):
        parse_completion(tool_result, "chat", tokenizer, Limits(), "smollm2")
