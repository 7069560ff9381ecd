"""``start_server``: the model, its drafter, the engine and the HTTP server of ``mlxspec serve``,
built from the command's options (the command itself only parses them and waits)."""

from __future__ import annotations

import functools
import ipaddress
import os
from collections.abc import Iterable

from mlxspec.errors import ServeAddressError
from mlxspec.serving.http import Server


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address) is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def start_server(
    model: str | None,
    *,
    host: str = "127.0.0.1",
    port: int = 8080,
    api_key: str | None = None,
    max_tokens: int = 512,
    max_tokens_limit: int = 4096,
    max_context: int | None = None,
    max_concurrent: int = 64,
    max_body_bytes: int = 1 << 20,
    max_batch: int = 32,
    prefill_step: int = 512,
    prompt_cache_size: int = 8,
    allowed_origins: Iterable[str] = (),
    draft_model: str | None = None,
    num_draft_tokens: int | str = "auto",
    prompt_lookup: bool = False,
    ngram_max: int = 3,
    draft_min_confidence: float = 0.0,
    feature_draft: str | None = None,
    shard: str | None = None,
) -> Server | None:
    """Load ``model`` (and ``draft_model``), and listen on ``host:port``; the caller runs
    :func:`mlxspec.serving.http.serve_forever` on the result. ``max_context`` defaults to the
    model's ``max_position_embeddings`` (8192 when the config has none). ``feature_draft``:
    ``"auto"`` (the head shipped for the model, if any) or a head's directory / Hub id, used when
    neither ``draft_model`` nor ``prompt_lookup`` is given.

    ``shard`` ("tensor" or "pipeline", under ``mlx.launch``): the model is sharded over the
    group; rank 0 serves (its engine sends each call to the other ranks:
    ``mlxspec.distributed.engine``), every other rank replays rank 0's engine calls until the
    server stops, then returns None.

    Raises:
        ServeAddressError: the address cannot be listened on.
    """
    from mlxspec.distributed import agreed_decoding, is_primary, load_sharded
    from mlxspec.load import load, read_config, resolve_model_path
    from mlxspec.serving.engine import Engine
    from mlxspec.serving.openai_api import Limits
    from mlxspec.speculative import FeatureDraft, make_draft

    path = resolve_model_path(model)
    nn_model, tokenizer = load_sharded(str(path), shard)
    if draft_model is not None and shard is not None and not is_primary():
        from mlxspec.distributed.drafting import Rank0Draft

        draft_nn, draft_tokenizer = Rank0Draft(), None  # rank 0 alone loads and runs it
    else:
        draft_nn, draft_tokenizer = load(draft_model) if draft_model is not None else (None, None)
    if draft_nn is None and not prompt_lookup and feature_draft not in (None, "none"):
        draft_nn = FeatureDraft(feature_draft)
    draft = make_draft(nn_model, tokenizer, draft_model=draft_nn, draft_tokenizer=draft_tokenizer,
                       prompt_lookup=prompt_lookup, ngram_max=ngram_max,
                       min_confidence=draft_min_confidence)
    make_engine = Engine
    if shard is not None:  # every rank decodes alike: one seed
        from mlxspec.distributed.engine import LeadingEngine, follow_engine

        num_draft_tokens, seed = agreed_decoding(num_draft_tokens, None)
        if not is_primary():
            follow_engine(nn_model, tokenizer, draft)
            return None
        make_engine = functools.partial(LeadingEngine, seed=seed)
    if max_context is None:
        max_context = int(read_config(path).get("max_position_embeddings") or 8192)
    limits = Limits(max_body_bytes=max_body_bytes, max_tokens=max_tokens_limit,
                    default_max_tokens=max_tokens, max_context=max_context,
                    max_concurrent=max_concurrent)
    engine = make_engine(nn_model, tokenizer, max_batch=max_batch, prefill_step=prefill_step,
                         draft=draft, num_draft_tokens=num_draft_tokens,
                         prompt_cache_size=prompt_cache_size)
    try:
        return Server(engine, model_id=model or os.path.basename(str(path)), host=host,
                      port=port, api_key=api_key, limits=limits,
                      allowed_origins=tuple(allowed_origins))
    except OSError as e:
        engine.close()
        raise ServeAddressError(f"cannot listen on {host}:{port}: {e.strerror}; choose another "
                                "--port or --host") from e
