"""What GGUF conversion checks so that a hostile or broken file never costs the user anything.

- Metadata fields are read through :func:`positive_int` / :func:`positive_number`: a string
  epsilon, a zero head count or a 4e9 block count is a one-line ``CorruptModelError``.
- :func:`check_shapes` builds the mlx-lm model class lazily from the derived config and compares
  every parameter shape with the file's tensors, before any slow work.
- :func:`check_loads` loads the finished work directory as mlx-lm would (lazily) with its
  tokenizer, and checks the vocabulary against the embedding rows: a conversion that cannot load
  is never put in place (never cached).
- :func:`check_replaceable` lets a conversion replace only a directory mlxspec created (it holds
  :data:`MARKER`), and :func:`clean_stale_work_dirs` deletes the ``.partial`` work directories of
  conversions whose process was killed.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from pathlib import Path

from mlxspec.errors import CorruptModelError, OutputExistsError, UnsupportedModelError
from mlxspec.model_checks import check_vocabulary, is_int, is_number

# Written into every converted directory: convert_gguf replaces only directories that hold it.
MARKER = ".mlxspec-conversion"
# Work directories beside the output: ".<name>.<pid>.<random>.partial" (being written) and
# ".<name>.<pid>.<random>.old" (a replaced conversion being deleted).
_WORK_DIR = re.compile(r"^\..+\.(?P<pid>\d+)\.[a-z0-9_]+\.(partial|old)$")
# OSError numbers that mean "the output location cannot be written".
NOT_WRITABLE = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT,
                errno.ENOTDIR, errno.EEXIST}


# -- metadata fields ------------------------------------------------------------------------------


def positive_int(meta: dict, key: str, default: int | None = None) -> int:
    """A positive integer field (a size or a count)."""
    value = meta.get(key, default)
    if value is None:
        raise CorruptModelError(f"GGUF metadata has no {key}")
    if isinstance(value, list) and value and all(is_int(v) for v in value):
        # a per-layer list: layers of different shapes
        raise UnsupportedModelError(f"GGUF {key} varies per layer, which mlx-lm does not support")
    if not is_int(value) or value <= 0:
        raise CorruptModelError(f"GGUF metadata {key} is {value!r}, not a positive integer")
    return value


def positive_number(meta: dict, key: str, default: float | None = None) -> float:
    """A positive finite number field (an epsilon, a RoPE base)."""
    value = meta.get(key, default)
    if value is None:
        raise CorruptModelError(f"GGUF metadata has no {key}")
    if not (is_number(value) and value > 0):
        raise CorruptModelError(f"GGUF metadata {key} is {value!r}, not a positive number")
    return float(value)


# -- the model the file describes -------------------------------------------------------------------


def check_shapes(shapes: dict[str, tuple[int, ...]], config: dict) -> None:
    """Every tensor the mlx-lm model class expects is in ``shapes`` (Hugging Face names) with
    the expected shape, and nothing else is: checked on a lazily built model (no weights are
    allocated), before any slow work or any write."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    try:
        model_class, args_class = _get_classes(config)
        model = model_class(args_class.from_dict(config))
    except (ValueError, TypeError, KeyError, AssertionError, ZeroDivisionError) as e:
        raise CorruptModelError(f"GGUF metadata does not describe a valid model: {e}") from None
    found = dict(shapes)
    if hasattr(model, "sanitize"):  # as mlx-lm's loader does (it may drop a tied lm_head)
        # mx.zeros is lazy: these placeholders never allocate their (possibly huge) shapes.
        placeholders = model.sanitize({k: mx.zeros(v, mx.float16) for k, v in found.items()})
        found = {k: tuple(v.shape) for k, v in placeholders.items()}
    expected = {name: tuple(w.shape) for name, w in tree_flatten(model.parameters())}
    for name, shape in found.items():
        if name not in expected:
            raise CorruptModelError(f"GGUF tensor for {name} does not belong in this model")
        if tuple(shape) != expected[name]:
            raise CorruptModelError(
                f"GGUF tensor for {name} has shape {tuple(shape)}, but the metadata implies "
                f"{expected[name]}"
            )
    missing = sorted(set(expected) - set(found))
    if missing:
        raise CorruptModelError(f"GGUF file lacks the tensor for {missing[0]}")


def check_loads(model_dir: Path) -> None:
    """Load the converted directory as mlx-lm would (lazily: no weights read) and its tokenizer:
    a conversion that cannot load is never put in place."""
    from mlx_lm.utils import load_model, load_tokenizer

    try:
        model, config = load_model(model_dir, lazy=True)
        tokenizer = load_tokenizer(model_dir, eos_token_ids=config.get("eos_token_id"))
    except Exception as e:  # tokenizers and transformers raise their own exception types
        raise CorruptModelError(f"the converted model does not load: {e}") from None
    check_vocabulary(model, tokenizer, config, "the GGUF file")


# -- the output directory ---------------------------------------------------------------------------


def check_replaceable(out_dir: Path) -> None:
    """Refuse to replace anything at ``out_dir`` that this converter did not create (an empty
    directory is fine): a file, a symlink, or a directory without the marker."""
    if not (out_dir.exists() or out_dir.is_symlink()):
        return
    ours = out_dir.is_dir() and not out_dir.is_symlink() and (
        (out_dir / MARKER).is_file() or not any(out_dir.iterdir())
    )
    if not ours:
        raise OutputExistsError(
            f"{out_dir} exists and is not a conversion made by mlxspec: nothing was changed; "
            "remove it or choose another output directory"
        )


def work_dir_prefix(out_dir: Path) -> str:
    """Prefix of this process's work directories for ``out_dir`` (see :data:`_WORK_DIR`)."""
    return f".{out_dir.name}.{os.getpid()}."


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def clean_stale_work_dirs(parent: Path) -> list[Path]:
    """Delete the ``.partial``/``.old`` work directories in ``parent`` whose converting process
    is gone (killed mid-conversion); returns what was deleted. Live conversions are left alone."""
    removed = []
    try:
        entries = list(parent.iterdir())
    except OSError:  # no cache yet, or one we cannot read: nothing to clean
        return removed
    for entry in entries:
        m = _WORK_DIR.match(entry.name)
        if m and entry.is_dir() and not entry.is_symlink() and not _alive(int(m["pid"])):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed
