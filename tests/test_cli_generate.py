"""`mlxspec generate` and `mlxspec chat` on bad input: one `error:` line, exit status 2, nothing
lost (chat reports the bad line and keeps the conversation). In-process (click's CliRunner)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from mlxspec.cli.main import cli


@pytest.fixture(scope="module")
def runner(smollm2_dir):
    return CliRunner()


def error_lines(result) -> list[str]:
    return [line for line in result.output.splitlines() if line.startswith("error:")]


@pytest.mark.parametrize(
    "args, stdin",
    [
        (["-p", "caf\udce9"], None),  # a Latin-1 byte in the argument (surrogate escape)
        (["-p", "-"], b"caf\xe9 au lait\n"),  # and on standard input
    ],
)
def test_generate_refuses_a_prompt_that_is_not_utf8(runner, args, stdin):
    result = runner.invoke(cli, ["generate", *args, "--max-tokens", "2"], input=stdin)
    assert result.exit_code == 2, result.output
    assert len(error_lines(result)) == 1 and "UTF-8" in error_lines(result)[0]


@pytest.mark.parametrize(
    "option", [["--seed", "-1"], ["--seed", "1e23"], ["--temp", "nan"], ["--top-p", "0"],
               ["--temp", "inf"]]
)
def test_generate_refuses_out_of_range_sampling_options(runner, option):
    result = runner.invoke(cli, ["generate", "-p", "Hi", "--max-tokens", "2", *option])
    assert result.exit_code == 2, result.output
    assert option[0] in result.output


def test_generate_json_is_the_responses_as_dict(runner):
    result = runner.invoke(cli, ["generate", "-p", "Name a color.", "--max-tokens", "4", "--json",
                                 "--prompt-lookup"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["generation_tokens"] == 4 and isinstance(data["text"], str)
    assert data["bandwidth_gbs"] > 0 and data["speculative"]["drafter"] == "prompt lookup"


def test_chat_reports_a_bad_line_and_keeps_the_conversation(runner, smollm2):
    from mlxspec.chat import ChatSession

    session = ChatSession(*smollm2, max_tokens=12)  # the same two turns without the bad line
    expected = [session.reply("My name is Ada."), session.reply("What is my name?")]
    lines = b"My name is Ada.\n\xff\xfe broken\nWhat is my name?\n"
    result = runner.invoke(cli, ["chat", "--max-tokens", "12"], input=lines)
    assert result.exit_code == 2, result.output
    errors = error_lines(result)
    assert len(errors) == 1 and "UTF-8" in errors[0]
    replies = [line for line in result.output.splitlines() if line and not line.startswith("error:")]
    assert replies == [text.strip() for text in expected]
