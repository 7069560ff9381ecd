"""The README and docs cite benchmark results that exist, and bench/results holds only indexed files.

Every number in the README and docs names the result file it comes from; a file deleted or renamed
without updating them would leave numbers without a source.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
INDEX = RESULTS / "README.md"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CITED = re.compile(r"bench/results/([a-z0-9_]+\.jsonl?)\b")
LINK = re.compile(r"\]\(([^)#]+)(?:#[^)]*)?\)")


def _indexed() -> dict[str, str]:
    """File name -> its row in the index table."""
    rows = {}
    for line in INDEX.read_text().splitlines():
        match = re.match(r"\|\s*`([^`]+)`\s*\|", line)
        if match:
            rows[match.group(1)] = line
    return rows


def _pending(row: str) -> bool:
    return "being written" in row or "being measured" in row


def test_every_result_file_is_indexed():
    indexed = _indexed()
    on_disk = {p.name for p in RESULTS.iterdir() if p.suffix in (".json", ".jsonl")}
    assert on_disk - set(indexed) == set(), "add these to bench/results/README.md"


def test_every_indexed_file_exists_unless_pending():
    missing = [name for name, row in _indexed().items()
               if not (RESULTS / name).is_file() and not _pending(row)]
    assert missing == []


def test_docs_cite_only_indexed_results():
    indexed = _indexed()
    for doc in DOCS:
        for name in CITED.findall(doc.read_text()):
            assert name in indexed, f"{doc.name} cites bench/results/{name}: not in the index"


def test_relative_links_resolve():
    for doc in [*DOCS, INDEX]:
        for target in LINK.findall(doc.read_text()):
            if "://" in target:
                continue
            assert (doc.parent / target).exists(), f"{doc.name} links to missing {target}"


def test_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300
