"""With a sharded target, rank 0 alone drafts and decides, and every rank runs its decisions: on
two real ring processes, a follower whose drafter would fail if asked anything, and whose own
decisions differ, still verifies rank 0's prompt lookup proposals (the full ones and an empty
one) and runs rank 0's plain stretches (cut to LOOKOUT steps where one process would check for a
match after each token); and a follower never loads rank 0's draft model, yet decodes the same
greedy text with it (the text equal to one process: test_sharded_generate.py)."""

from __future__ import annotations

import json
import sys

import pytest
from ring import ring

from mlxspec.distributed.drafting import LOOKOUT
from mlxspec.speculative.drafters import PromptLookupDrafter

pytestmark = pytest.mark.slow
TIMEOUT = 120  # s for two small processes on a loaded 2-core host (a few s idle)
CONTEXTS = ([5, 6, 7, 8, 9, 5, 6], [1, 2, 3])  # a repeated bigram; nothing repeated

SCRIPT = """
import json, sys
import mlxspec
import mlx.core as mx
from mlxspec.distributed.drafting import SharedDrafter
from mlxspec.speculative.drafters import Drafter, PromptLookupDrafter

class Refusing(Drafter):
    name = "prompt lookup"
    def begin(self, context): raise AssertionError("a follower began drafting")
    def extend(self, tokens): raise AssertionError("a follower extended its drafter")
    def propose(self, *args, **kwargs): raise AssertionError("a follower drafted")

def refuse():
    raise AssertionError("a follower drafted")

group = mx.distributed.init()
leader = group.rank() == 0
inner = PromptLookupDrafter() if leader else Refusing()
shared = SharedDrafter(inner, group)
got = []
for context in CONTEXTS:
    shared.begin(context)
    # the follower's own decision (a plain stretch of 9) must not matter
    k, stretch, draft = shared.agree(*((4, 0) if leader else (0, 9)), False, 4,
                                     lambda: shared.propose(4, None) if leader else refuse())
    got.append([k, stretch, draft.tokens])
    shared.extend([0])
for watched in (False, True):  # rank 0 pauses for 7 plain steps; the follower would draft 2
    k, stretch, draft = shared.agree(*((0, 7) if leader else (2, 0)), watched, 4, refuse)
    got.append([k, stretch, draft])
sys.stdout.write(json.dumps(got) + "\\n")
"""


def test_followers_verify_the_proposals_rank_0_alone_drafted(tmp_path):
    want = []
    for context in CONTEXTS:
        drafter = PromptLookupDrafter()
        drafter.begin(context)
        want.append([4, 0, drafter.propose(4, None).tokens])
    assert want[0][2] == [7, 8, 9, 5] and want[1][2] == []
    want += [[0, 7, None], [0, LOOKOUT, None]]  # a watched stretch: LOOKOUT steps, then decide
    assert LOOKOUT < 7
    script = f"CONTEXTS = {CONTEXTS!r}\n{SCRIPT}"
    with ring([], tmp_path, program=(sys.executable, "-c", script)) as procs:
        outs = [p.communicate(timeout=TIMEOUT) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in outs]
    for out, _ in outs:
        assert json.loads(out.splitlines()[-1]) == want


# Each rank: the default model sharded; rank 0 also loads it whole as its draft model, the
# follower passes the stand-in the CLI passes. Prints the drafter's type, the MLX memory held
# (MiB), and the greedy text of 10 tokens, plain and speculative.
DRAFT_MODEL = """
import json, sys
import mlx.core as mx
from mlxspec.distributed import load_sharded
from mlxspec.distributed.drafting import Rank0Draft
from mlxspec.generate import stream_generate
from mlxspec.load import load
from mlxspec.speculative import make_drafter

model, tokenizer = load_sharded(None, "tensor")
leader = mx.distributed.init().rank() == 0
draft = load(None)[0] if leader else Rank0Draft()
drafter = make_drafter(tokenizer, model, draft_model=draft, draft_tokenizer=tokenizer if leader else None)
mx.eval(model.parameters())
held = mx.get_active_memory() / 2**20
prompt = "Count from one to ten: one, two,"
texts = []
for kw in ({}, {"draft": drafter, "num_draft_tokens": 3}):
    responses = list(stream_generate(model, tokenizer, prompt, max_tokens=10, **kw))
    texts.append("".join(r.text for r in responses))
accepted = responses[-1].spec_stats.accepted
sys.__stdout__.write(json.dumps([type(drafter).__name__, held, texts, accepted]) + "\\n")
"""


def test_a_follower_never_loads_the_draft_model_rank_0_drafts_with(tmp_path):
    with ring([], tmp_path, program=(sys.executable, "-c", DRAFT_MODEL)) as procs:
        outs = [p.communicate(timeout=TIMEOUT) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in outs]
    (kind0, held0, texts0, accepted), (kind1, held1, texts1, _) = (
        json.loads(out.splitlines()[-1]) for out, _ in outs)
    assert kind0 == "DraftModelDrafter" and kind1 == "FollowerDrafter"
    assert accepted > 0  # the target drafting for itself: most of its drafts are kept
    # rank 0 holds its shard and the whole draft (about 95 MiB); the follower its shard alone
    assert held1 < held0 - 60, (held0, held1)
    assert texts0[0] == texts0[1] == texts1[0] == texts1[1] and texts0[0]
