"""Constrained decoding (mlxspec.grammar): answers valid under their schema, the matcher following
histories that branch and roll back, and speculative decoding under a schema giving exactly the
text plain decoding gives.

References: ``jsonschema`` validation of the answers, a fresh matcher fed the same history, plain
(non-speculative) decoding with the same processor.
"""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from tiny_models import make_tiny_model, perturbed_copy

jsonschema = pytest.importorskip("jsonschema")

from mlxspec.errors import InvalidArgumentError  # noqa: E402
from mlxspec.generate import stream_generate  # noqa: E402
from mlxspec.grammar import (  # noqa: E402
    GrammarProcessor,
    json_schema_grammar,
    schema_processor,
)
from mlxspec.load import load  # noqa: E402
from mlxspec.serving.batch_jsonl import parse_line  # noqa: E402

# Bounded strings and numbers: a random tiny model then always finishes its answer.
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "ok"],
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "ok": {"type": "boolean"},
                         "tags": {"type": "array", "maxItems": 2,
                                  "items": {"enum": ["red", "green", "blue"]}}}}
# Held out from the grammar's development: what the real model is asked for.
SCHEMAS = [
    {"type": "object", "additionalProperties": False, "required": ["city", "country"],
     "properties": {"city": {"type": "string", "maxLength": 30},
                    "country": {"type": "string", "maxLength": 30}}},
    {"type": "object", "additionalProperties": False, "required": ["answer", "confidence"],
     "properties": {"answer": {"enum": ["yes", "no"]},
                    "confidence": {"type": "number", "minimum": 0, "maximum": 1}}},
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("structured")
    target = make_tiny_model(root / "target")
    return load(str(target)), load(str(perturbed_copy(target, root / "draft", noise=0.3)))


def _tokens(model, tokenizer, prompt, processor, stats=None, **kw) -> tuple[list[int], str]:
    responses = list(stream_generate(model, tokenizer, prompt, max_tokens=120,
                                     logits_processors=[processor], **kw))
    if stats is not None:  # speculation ran, and some drafts were rejected (rolled back)
        spec = responses[-1].spec_stats
        assert spec.drafted > spec.accepted > 0, spec.as_dict()
    return [r.token for r in responses], "".join(r.text for r in responses)


def test_schema_answers_of_the_default_model_validate(smollm2):
    model, tokenizer = smollm2
    questions = ["Where is the Eiffel Tower? Answer as JSON.", "Is water wet? Answer as JSON."]
    for schema, question in zip(SCHEMAS, questions, strict=True):
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                               add_generation_prompt=True)
        responses = list(stream_generate(model, tokenizer, prompt, max_tokens=64,
                                         logits_processors=[schema_processor(tokenizer, schema)]))
        assert responses[-1].finish_reason == "stop"
        jsonschema.validate(json.loads("".join(r.text for r in responses)), schema)


def test_random_model_answers_validate_and_json_object_is_an_object(tiny):
    (model, tokenizer), _ = tiny
    for i, schema in enumerate([PERSON, None]):
        tokens, text = _tokens(model, tokenizer, f"person {i}:", schema_processor(tokenizer, schema))
        assert tokens[-1] in tokenizer.eos_token_ids, text  # finished, not cut off
        value = json.loads(text)
        assert isinstance(value, dict)
        if schema is not None:
            jsonschema.validate(value, schema)


@pytest.mark.parametrize("drafter", ["prompt_lookup", "draft_model"])
def test_greedy_speculative_equals_plain_under_a_schema(tiny, drafter):
    (model, tokenizer), (draft, _) = tiny
    prompt = 'person: {"name": "ab", "age": 7, "ok": true} again: '
    plain = _tokens(model, tokenizer, prompt, schema_processor(tokenizer, PERSON))
    kw = {"prompt_lookup": True} if drafter == "prompt_lookup" else {"draft_model": draft}
    spec = _tokens(model, tokenizer, prompt, schema_processor(tokenizer, PERSON), stats=True,
                   num_draft_tokens=4, **kw)
    assert spec == plain
    jsonschema.validate(json.loads(plain[1]), PERSON)


def test_seeded_speculative_sampling_equals_seeded_plain_under_a_schema(tiny):
    (model, tokenizer), (draft, _) = tiny
    kw = {"temp": 1.0, "seed": 3}
    plain = _tokens(model, tokenizer, "p:", schema_processor(tokenizer, PERSON), **kw)
    spec = _tokens(model, tokenizer, "p:", schema_processor(tokenizer, PERSON), stats=True,
                   draft_model=draft, num_draft_tokens=3, **kw)
    assert spec == plain
    jsonschema.validate(json.loads(plain[1]), PERSON)


def _allowed(processor, history) -> list[bool]:
    logits = processor(mx.array(history), mx.zeros((1, 300)))
    return (logits[0] > -1e30).tolist()


def test_matcher_follows_branching_histories_like_a_fresh_one(tiny):
    (_, tokenizer), _ = tiny
    grammar = json_schema_grammar(PERSON)
    prompt = [65, 66, 67]
    a = prompt + tokenizer.encode('{"name": "x', add_special_tokens=False)
    b = prompt + tokenizer.encode('{"name": "yz", "a', add_special_tokens=False)
    shared = GrammarProcessor(tokenizer, grammar, start=len(prompt))
    for history in (a, b, a, prompt, b):  # forward, branch, back, all the way back, forward
        fresh = GrammarProcessor(tokenizer, grammar, start=len(prompt))
        assert _allowed(shared, history) == _allowed(fresh, history)
    allowed = _allowed(shared, prompt)
    brace, bracket = (tokenizer.encode(c, add_special_tokens=False)[0] for c in "{[")
    assert allowed[brace] and not allowed[bracket] and not any(allowed[260:])


def test_valid_prefix_stops_at_the_first_refused_draft(tiny):
    (_, tokenizer), _ = tiny
    processor = schema_processor(tokenizer, PERSON)
    drafts = tokenizer.encode('{"name": "a"}', add_special_tokens=False)  # misses age and ok
    assert processor.valid_prefix(mx.array([1, 2]), drafts) == len(drafts) - 1
    a_view = processor.view(1)  # histories without their first token: the same matcher
    assert a_view.valid_prefix(mx.array([2]), drafts[:3]) == 3


def test_unenforceable_schemas_and_bad_batch_lines_are_refused(tiny):
    (_, tokenizer), _ = tiny
    with pytest.raises(InvalidArgumentError, match="JSON schema"):
        json_schema_grammar({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}})
    with pytest.raises(InvalidArgumentError):
        json_schema_grammar(["not", "an", "object"])
    key, request = parse_line(json.dumps({"id": "a", "prompt": "x", "json_schema": PERSON}), 1,
                              tokenizer, {})
    assert key == "a" and request.grammar == json_schema_grammar(PERSON)
    _, error = parse_line(json.dumps({"prompt": "x", "json_schema": "no"}), 2, tokenizer, {})
    assert isinstance(error, ValueError) and "json_schema" in str(error)


def test_generate_command_answers_under_a_schema_file(tmp_path):
    from click.testing import CliRunner

    from mlxspec.cli.main import cli

    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(PERSON))
    model_dir = str(make_tiny_model(tmp_path / "tiny"))
    runner = CliRunner()
    result = runner.invoke(cli, ["generate", "-m", model_dir, "-p", "x", "--no-chat-template",
                                 "--json-schema", str(schema), "--json", "--max-tokens", "120"])
    assert result.exit_code == 0, result.output
    jsonschema.validate(json.loads(json.loads(result.stdout)["text"]), PERSON)
    schema.write_text("{not json")
    result = runner.invoke(cli, ["generate", "-m", model_dir, "--json-schema", str(schema)])
    assert result.exit_code == 2 and "cannot read the JSON schema" in result.output
