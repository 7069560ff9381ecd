"""With a sharded target, rank 0 alone drafts and every rank gets its proposals: on two real ring
processes, a follower whose drafter would fail if asked anything still verifies rank 0's prompt
lookup proposals, the full ones and an empty one (greedy text equal to one process:
test_sharded_generate.py)."""

from __future__ import annotations

import json
import sys

import pytest
from ring import ring

from mlxspec.speculative.drafters import PromptLookupDrafter

pytestmark = pytest.mark.slow
TIMEOUT = 120  # s for two small processes on a loaded 2-core host (a few s idle)
CONTEXTS = ([5, 6, 7, 8, 9, 5, 6], [1, 2, 3])  # a repeated bigram; nothing repeated

SCRIPT = """
import json, sys
import mlxspec
import mlx.core as mx
from mlxspec.distributed.drafting import share_drafter
from mlxspec.speculative.drafters import Drafter, PromptLookupDrafter

class Refusing(Drafter):
    name = "prompt lookup"
    def begin(self, context): raise AssertionError("a follower began drafting")
    def extend(self, tokens): raise AssertionError("a follower extended its drafter")
    def propose(self, *args, **kwargs): raise AssertionError("a follower drafted")

group = mx.distributed.init()
inner = PromptLookupDrafter() if group.rank() == 0 else Refusing()
shared = share_drafter(inner, group)
got = []
for context in CONTEXTS:
    shared.begin(context)
    got.append(shared.propose(4, None).tokens)
    shared.extend([0])
sys.stdout.write(json.dumps(got) + "\\n")
"""


def test_followers_verify_the_proposals_rank_0_alone_drafted(tmp_path):
    want = []
    for context in CONTEXTS:
        drafter = PromptLookupDrafter()
        drafter.begin(context)
        want.append(drafter.propose(4, None).tokens)
    assert want[0] == [7, 8, 9, 5] and want[1] == []
    script = f"CONTEXTS = {CONTEXTS!r}\n{SCRIPT}"
    with ring([], tmp_path, program=(sys.executable, "-c", script)) as procs:
        outs = [p.communicate(timeout=TIMEOUT) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in outs]
    for out, _ in outs:
        assert json.loads(out.splitlines()[-1]) == want
