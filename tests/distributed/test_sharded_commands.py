"""``chat``, ``batch`` and ``serve`` with a target sharded over two real ring processes on
loopback: rank 0 reads the input (stdin, the prompts file, HTTP) and sends it to the other rank
(mlxspec.distributed.follow), and the answers are the one-process greedy answers; rank 0 alone
prints and writes.

Each case is one short run of the default model (a few tokens, bounded waits), as in
test_sharded_generate.py.
"""

from __future__ import annotations

import json
import signal
import time
import urllib.request

import pytest
from ring import free_ports, json_of, one_process, ring

pytestmark = pytest.mark.slow
TIMEOUT = 240  # s for one two-rank run on a loaded 2-core host (about 20 s idle)


def test_sharded_chat_answers_two_turns_as_one_process(tmp_path):
    turns = "Name a fruit.\nNow name a vegetable.\n/quit\n"
    args = ["chat", "--temp", "0", "--max-tokens", "8", "--prompt-lookup"]
    want = one_process(args, input=turns)
    assert want.returncode == 0, want.stderr
    with ring([*args, "--shard", "tensor"], tmp_path, stdin=True) as (rank0, rank1):
        rank1.stdin.write(turns)  # mlx.launch gives every rank the input: only rank 0 reads it
        rank1.stdin.close()
        out, err = rank0.communicate(turns, timeout=TIMEOUT)
        rank1.wait(timeout=30)
        follower = rank1.stdout.read()
    assert rank0.returncode == 0 and rank1.returncode == 0, err
    replies = out.splitlines()
    assert out == want.stdout and len(replies) == 2 and replies[0] != replies[1]
    assert follower == ""


def test_sharded_batch_writes_the_one_process_results(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        '{"id": "a", "prompt": "The capital of France is"}\n'
        '{"id": "b", "messages": [{"role": "user", "content": "Name a color."}]}\n'
        '{"id": "c", "prompt": "1, 2, 3, 4,", "max_tokens": 5}\n')
    # two rows decoded together, then the last one alone and speculative (prompt lookup)
    args = ["batch", str(prompts), "--temp", "0", "--max-tokens", "10", "--batch-size", "2",
            "--prompt-lookup"]
    want = one_process([*args, "-o", str(tmp_path / "one.jsonl")])
    assert want.returncode == 0, want.stderr
    out_path = tmp_path / "sharded.jsonl"
    with ring([*args, "-o", str(out_path), "--shard", "pipeline"], tmp_path) as (rank0, rank1):
        out, err = rank0.communicate(timeout=TIMEOUT)
        follower, _ = rank1.communicate(timeout=30)
    assert rank0.returncode == 0 and rank1.returncode == 0, err

    def results(path):
        return sorted(path.read_text().splitlines())

    got = results(out_path)
    assert got == results(tmp_path / "one.jsonl") and len(got) == 3
    assert all("error" not in json.loads(line) for line in got)
    assert follower == "" and json.loads(err.strip().splitlines()[-1])["completed"] == 3


def _wait_for(url: str, rank0, deadline: float) -> None:
    while True:
        try:
            urllib.request.urlopen(url + "/health", timeout=2)
            return
        except OSError:
            assert rank0.poll() is None, rank0.stderr.read()
            assert time.monotonic() < deadline, "the sharded server did not start"
            time.sleep(0.5)


def test_sharded_serve_answers_a_completion_as_one_process(tmp_path):
    prompt = "The capital of France is"
    want = one_process(["generate", "-p", prompt, "--no-chat-template", "--temp", "0",
                        "--max-tokens", "8", "--draft", "none", "--json"])
    assert want.returncode == 0, want.stderr
    port = free_ports(1)[0]
    url = f"http://127.0.0.1:{port}"
    args = ["serve", "--port", str(port), "--prompt-lookup", "--shard", "pipeline"]
    with ring(args, tmp_path) as (rank0, rank1):
        _wait_for(url, rank0, time.monotonic() + TIMEOUT)
        body = json.dumps({"prompt": prompt, "max_tokens": 8, "temperature": 0}).encode()
        request = urllib.request.Request(url + "/v1/completions", body,
                                         {"Content-Type": "application/json"})
        answer = json.loads(urllib.request.urlopen(request, timeout=TIMEOUT).read())
        rank0.send_signal(signal.SIGTERM)  # drains, then ends the other rank
        _, err = rank0.communicate(timeout=60)
        follower, _ = rank1.communicate(timeout=30)
    assert rank0.returncode == 0 and rank1.returncode == 0, err
    assert answer["choices"][0]["text"] == json_of(want.stdout)["text"]
    assert answer["usage"]["completion_tokens"] == 8
    assert follower == ""
