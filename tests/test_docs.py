"""The documents say what the code has: the reference pages are what
``python -m vllm_output_rate.tools.gen_docs`` writes now, every metric,
setting, option, command and span attribute of the code is named in the
docs, the README stays a short newcomer's path, and the paths the documents
name are checkout paths that exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from harness import REPO
from vllm_output_rate import settings
from vllm_output_rate.telemetry import metrics
from vllm_output_rate.tools import cli, gen_docs

DOCS = REPO / "docs"
README = REPO / "README.md"
#: verbatim history: old figures, old paths, old names; not checked
HISTORY = {"benchmark-history.md", "fairness-history.md", "reliability-history.md", "test-history.md"}
README_MAX_BYTES = 20_000


def current_docs() -> dict[str, str]:
    """README, the top-level documents and docs/*.md but the history pages."""
    paths = [README, REPO / "BENCHMARKS.md", REPO / "RELIABILITY.md",
             *(p for p in sorted(DOCS.glob("*.md")) if p.name not in HISTORY)]
    return {str(p.relative_to(REPO)): p.read_text() for p in paths}


def all_docs_text() -> str:
    return "\n".join(current_docs().values())


@pytest.mark.parametrize("page", sorted(gen_docs.pages()))
def test_generated_page_is_current(page):
    expected = gen_docs.pages()[page]
    path = REPO / page
    assert path.exists(), f"{page} missing: run python -m vllm_output_rate.tools.gen_docs"
    assert path.read_text() == expected, (
        f"{page} differs from what the code's tables give: run "
        "python -m vllm_output_rate.tools.gen_docs (make docs) and commit it")


def _missing(names, text: str) -> list[str]:
    return sorted(n for n in names if not re.search(rf"(?<![\w.-]){re.escape(n)}(?![\w-])", text))


def test_every_metric_is_in_the_docs():
    names = [m.full_name for m in metrics.METRICS]
    assert _missing(names, all_docs_text()) == []


def test_every_setting_is_in_the_docs():
    assert _missing([s.name for s in settings.SETTINGS], all_docs_text()) == []


def test_every_option_and_command_is_in_the_docs():
    text = all_docs_text()
    assert _missing(gen_docs.option_names(), text) == []
    assert _missing([f"vllm-output-rate {c}" for c in cli.COMMANDS], text) == []


#: span names and attributes as the tracing code spells them
_ATTRIBUTE = re.compile(r"""["']((?:output_rate|gen_ai)\.[a-z0-9_.]+|user\.id)["']""")


def span_names_in_code() -> set[str]:
    found = set()
    for path in sorted((REPO / "tracing").rglob("*.py")):
        found.update(_ATTRIBUTE.findall(path.read_text()))
    return found


def test_every_span_and_attribute_is_in_the_observability_page():
    names = span_names_in_code()
    assert len(names) > 20, "the scan of tracing/ found almost nothing: is it still the way spans are named?"
    assert _missing(names, (DOCS / "observability.md").read_text()) == []


def test_readme_is_short_and_shows_the_pictures():
    text = README.read_text()
    assert len(text.encode()) < README_MAX_BYTES
    head = text[:4000]
    pictures = re.findall(r"!\[[^\]]*\]\((docs/img/[^)]+\.png)\)", head)
    assert pictures, "the README shows what an operator sees near its top"
    for rel in pictures:
        assert (REPO / rel).exists(), rel
    assert "make pictures" in text


def test_links_between_documents_resolve():
    broken = []
    for rel, text in current_docs().items():
        base = (REPO / rel).parent
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (base / target).exists():
                broken.append(f"{rel}: {target}")
    assert broken == []


#: a path of the repository as the documents name it: `folder/file.ext`
_PATH = re.compile(r"`((?:vllm_patch|telemetry|tracing|dashboards|scripts|tests|docs)/[\w./-]*\w)`")


def test_paths_named_are_checkout_paths_that_exist():
    wrong, gone = [], []
    for rel, text in current_docs().items():
        # installed module paths are import names (vllm_output_rate.tools.verify), never paths
        wrong += [f"{rel}: {m}" for m in re.findall(r"`vllm_output_rate/[\w./-]*`", text)]
        for path in _PATH.findall(text):
            if not (REPO / path).exists():
                gone.append(f"{rel}: {path}")
    assert wrong == [], "name the checkout path (vllm_patch/..., scripts/...), not the installed one"
    assert sorted(set(gone)) == []


def test_docs_pages_are_linked_from_the_readme():
    text = README.read_text()
    unlinked = [p.name for p in sorted(DOCS.glob("*.md")) if f"docs/{p.name}" not in text]
    assert unlinked == []


#: a commit name as the documents used to cite one: 7 to 40 hex digits, at
#: least one a-f and one 0-9 (so that 134217728 or "defaced" are not taken)
COMMIT = re.compile(r"(?<![\w.-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![\w-])")
#: the documents that state the current truth and cite no commit (history
#: goes to the history pages)
NO_COMMITS = ("README.md", "tests/README.md", "dashboards/README.md", "FAIRNESS.md", "RELIABILITY.md",
              "BENCHMARKS.md")


def commits_cited(text: str) -> list[str]:
    return COMMIT.findall(text)


def test_current_truth_documents_cite_no_commit():
    pages = [REPO / name for name in NO_COMMITS]
    pages += [p for p in sorted(DOCS.glob("*.md")) if p.name not in HISTORY]
    found = {str(p.relative_to(REPO)): commits_cited(p.read_text()) for p in pages}
    assert {page: names for page, names in found.items() if names} == {}, (
        "commit names in current-truth documents: state the date and the command; "
        "runs of earlier code go to the history pages")


def test_the_commit_check_sees_commits():
    assert commits_cited("on `959024c`, 22 min; and 1ffbb2c's run") == ["959024c", "1ffbb2c"]
    assert commits_cited("134217728 bytes, defaced, sha256 a1b2c3d4e5f6-x, v0.34.0") == []
