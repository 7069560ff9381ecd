"""Typed errors raised where the user can act on them.

Every error carries a one-line message that names the problem and the fix. The CLI prints
``error: <message>`` and exits with status 2 for any ``MlxspecError`` (``--debug`` shows the
traceback); anything else is a bug and keeps its traceback.
"""


class MlxspecError(Exception):
    """Base class for user-facing errors (bad input, missing model, refused operation)."""

    exit_code = 2


class ModelNotFoundError(MlxspecError):
    """The model spec is neither a local directory, a ``.gguf`` file nor a reachable Hub repo."""


class DefaultModelMissingError(ModelNotFoundError):
    """No ``--model`` was given and the embedded default model package is not installed."""


class UnsafeCheckpointError(MlxspecError):
    """The checkpoint is a pickle (``.bin``/``.pt``) that mlxspec refuses to unpickle."""


class CorruptModelError(MlxspecError):
    """A weight, config or GGUF file exists but cannot be read."""


class UnsupportedModelError(MlxspecError):
    """The architecture, tensor type or option combination is not supported."""


class TokenizerMismatchError(MlxspecError):
    """A draft model does not share the target's tokenizer."""


class QuantizationError(MlxspecError):
    """Quantization options are invalid for this model (bits, group size, already quantized)."""


class OutputExistsError(MlxspecError):
    """The output directory exists; pass ``--force`` to overwrite it."""


class EvaluationError(MlxspecError):
    """Evaluation is impossible or its results are missing or failed the gate."""


class HubError(MlxspecError):
    """A Hugging Face Hub operation failed (no token, no permission, conflict, network)."""


class UnsafeUploadError(HubError):
    """The folder to upload holds files that are not part of a model, or links leaving it."""


class InvalidRepoIdError(HubError):
    """A Hub repo id is malformed (what is wrong is in the message); nothing was contacted."""


class NotWritableError(MlxspecError):
    """A cache or output location cannot be written: read-only, no permission, or disk full."""


class InvalidArgumentError(MlxspecError, ValueError):
    """A generation argument is out of range (sampling, max_tokens, seed, token ids, context)."""


class ServeAddressError(MlxspecError):
    """``mlxspec serve`` cannot listen on the address asked for (in use, not ours)."""
