"""Keep Hugging Face tokens out of every line mlxspec prints or logs.

The token reaches error messages when a server echoes the ``Authorization`` header, or when a
chained exception carries a request. :func:`redact` replaces every known token value (``HF_TOKEN``,
``HUGGING_FACE_HUB_TOKEN``, the token saved by ``hf auth login``) and whatever follows a
``Bearer``/``Authorization`` with ``***``; :func:`quiet_library_logs` silences (or, with
``--debug``, redacts) the log lines of huggingface_hub and transformers so that the one-line
error rule holds.
"""

from __future__ import annotations

import logging
import os
import re

MASK = "***"
TOKEN_ENV_VARS = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")
LIBRARY_LOGGERS = ("huggingface_hub", "transformers", "httpx", "httpx2", "urllib3", "filelock")
_HEADER = re.compile(r"(?i)(bearer\s+|authorization['\"]?\s*[:=]\s*['\"]?(?:bearer\s+)?)[^\s'\",}]+")


def known_tokens() -> list[str]:
    """Every token value this process could send (environment and the saved token file)."""
    tokens = [os.environ.get(name) for name in TOKEN_ENV_VARS]
    try:
        from huggingface_hub import get_token

        tokens.append(get_token())
    except Exception:  # an unreadable token file or no huggingface_hub: nothing to add
        pass
    # Longest first, so a token that contains another is masked whole.
    return sorted({t.strip() for t in tokens if t and len(t.strip()) >= 4}, key=len, reverse=True)


def redact(text: str) -> str:
    """``text`` with every token and Authorization header value replaced by ``***``."""
    for token in known_tokens():
        text = text.replace(token, MASK)
    return _HEADER.sub(lambda m: m.group(1) + MASK, text)


def _redacting_factory(make_record):
    def factory(*args, **kwargs) -> logging.LogRecord:
        record = make_record(*args, **kwargs)
        try:
            message = record.getMessage()
        except Exception:  # a malformed record: leave it to logging's own error report
            return record
        record.msg, record.args = redact(message), None
        return record

    factory.redacting = True
    return factory


def quiet_library_logs(debug: bool) -> None:
    """Silence third-party loggers (retries, advisory warnings) unless ``debug``; with ``debug``
    keep their warnings. Either way every log record is masked as it is created, so no token
    reaches a log line."""
    import sys

    import huggingface_hub.utils.logging  # noqa: F401  (configures its logger: then override it)

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "warning" if debug else "critical")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    if not getattr(logging.getLogRecordFactory(), "redacting", False):
        logging.setLogRecordFactory(_redacting_factory(logging.getLogRecordFactory()))
    for name in LIBRARY_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING if debug else logging.CRITICAL + 1)
    if "transformers" in sys.modules:
        import transformers

        transformers.logging.set_verbosity(logging.WARNING if debug else logging.CRITICAL + 1)
