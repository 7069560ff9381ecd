"""Quality evaluation: perplexity, divergence from a reference model, and draft acceptance.

Everything here runs teacher-forced forward passes over fixed token windows; nothing is
generated. One module per step:

- :mod:`~mlxspec.evaluation.windows`: the token windows (built-in held-out text or a file);
- :mod:`~mlxspec.evaluation.domains`: the built-in held-out text by domain (prose, code, chat,
  technical), what ``mlxspec eval`` and the quality gate measure by default;
- :mod:`~mlxspec.evaluation.metrics`: perplexity, comparison with a reference, acceptance;
- :mod:`~mlxspec.evaluation.gate`: the pass/fail verdict per bit width;
- :mod:`~mlxspec.evaluation.records`: ``mlxspec_eval.json`` and the recorded source model;
- :mod:`~mlxspec.evaluation.flow`: :func:`evaluate` and :func:`evaluate_saved`, what the CLI calls.
"""

from mlxspec.evaluation.domains import (
    BUILTIN_DOMAINS_TITLE,
    DEFAULT_DOMAIN_WINDOWS,
    DOMAIN_SOURCES,
    domain_windows,
)
from mlxspec.evaluation.flow import check_same_tokenizer, dense_on_cpu, evaluate, evaluate_saved
from mlxspec.evaluation.gate import DEFAULT_THRESHOLDS, default_thresholds, gate, verdict_line
from mlxspec.evaluation.metrics import (
    MAX_DRAFT_TOKENS,
    TEMPERATURES,
    acceptance,
    compare,
    compare_domains,
    perplexity,
    tokens_per_pass,
)
from mlxspec.evaluation.records import (
    EVAL_FILE,
    SOURCE_KEY,
    read_results,
    save_results,
    source_model,
)
from mlxspec.evaluation.windows import (
    BUILTIN_TEXT_TITLE,
    DEFAULT_WINDOW_TOKENS,
    DEFAULT_WINDOWS,
    builtin_text,
    builtin_windows,
    take_windows,
    text_windows,
)

__all__ = [
    "BUILTIN_DOMAINS_TITLE", "DEFAULT_DOMAIN_WINDOWS", "DOMAIN_SOURCES", "compare_domains",
    "domain_windows",
    "BUILTIN_TEXT_TITLE", "DEFAULT_THRESHOLDS", "DEFAULT_WINDOWS", "DEFAULT_WINDOW_TOKENS",
    "EVAL_FILE", "MAX_DRAFT_TOKENS", "SOURCE_KEY", "TEMPERATURES", "acceptance", "builtin_text",
    "builtin_windows", "check_same_tokenizer", "compare", "default_thresholds", "dense_on_cpu",
    "evaluate", "evaluate_saved", "gate", "perplexity", "read_results", "save_results",
    "source_model", "take_windows", "text_windows", "tokens_per_pass", "verdict_line",
]
