"""A target sharded over ``mx.distributed`` (tensor or pipeline parallel), run under ``mlx.launch``.

Every rank runs the same decoding loop on the same tokens: the sharded layers exchange
activations inside each forward pass (an all-reduce per layer for tensor parallelism, one hop per
rank for a pipeline), so the logits, and hence every greedy token and seeded sample, agree on
every rank. Rank 0 alone drafts and sends its proposals (:mod:`.drafting`); each rank loads only
the weights it keeps. Rank 0 alone prints; a watchdog ends a rank whose peer stopped answering.
See docs/distributed.md.
"""

from mlxspec.distributed.group import (
    DistributedError,
    Watchdog,
    agreed_decoding,
    barrier,
    group_report,
    init_group,
    is_primary,
    sharded_run,
)
from mlxspec.distributed.shard import SHARD_MODES, load_sharded, shard_model

__all__ = [
    "SHARD_MODES",
    "DistributedError",
    "Watchdog",
    "agreed_decoding",
    "barrier",
    "group_report",
    "init_group",
    "is_primary",
    "load_sharded",
    "shard_model",
    "sharded_run",
]
