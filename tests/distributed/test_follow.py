"""What rank 0 sends its followers survives the wire: a request's every field comes back equal
after the JSON round trip (two real ranks: test_sharded_commands.py)."""

from __future__ import annotations

import dataclasses
import json

from mlxspec.distributed.engine import _request
from mlxspec.serving.requests import Request


def test_a_submitted_request_comes_back_equal_from_its_message():
    sent = Request([1, 2, 3], max_tokens=7, temp=0.7, top_p=0.9, top_k=40, min_p=0.05,
                   stop=("\n\n", "END"), seed=11, logprobs=True, top_logprobs=2,
                   repetition_penalty=1.1, logit_bias={17: -100.0, 3: 2.5},
                   grammar='root ::= "yes" | "no"')
    wire = json.loads(json.dumps(dataclasses.asdict(sent), ensure_ascii=False))
    assert _request(wire) == sent
