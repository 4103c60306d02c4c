"""The README and the pages under docs/: every Python sample runs, the README's quickstart and
framework swaps do what they say, the README keeps its shape (the two commands first, one
headline figure that the results back), and every relative link leads somewhere."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]

DEMO_COMMAND = "bash scripts/setup.sh && .venv/bin/python -m kvboost_rag.demo"
TEST_COMMAND = "bash scripts/setup.sh --test && bash .ci/install-redis.sh && bash scripts/test.sh"
HEADLINE = "3.92x"
HEADLINE_REPORT = ROOT / "bench" / "results" / "corpus_1000_defaults.md"


def python_samples(page: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)


SAMPLES = [(page, index, code) for page in PAGES for index, code in enumerate(python_samples(page))]


def sample_id(sample: tuple[Path, int, str]) -> str:
    page, index, _ = sample
    return f"{page.relative_to(ROOT)}-{index}"


def run_sample(page: Path, index: int, code: str) -> dict:
    namespace = {"__name__": "__readme__"}
    exec(compile(code, f"{page.relative_to(ROOT)} sample {index}", "exec", dont_inherit=True), namespace)
    return namespace


def readme_sample(marker: str) -> tuple[int, str]:
    found = [(i, code) for i, code in enumerate(python_samples(README)) if marker in code]
    assert len(found) == 1, f"expected one README sample containing {marker!r}, found {len(found)}"
    return found[0]


# --- shape of the README (no model needed) ---------------------------------------------------


def test_readme_starts_with_the_two_commands():
    blocks = re.findall(r"```(\w*)\n(.*?)```", README.read_text(), flags=re.S)
    assert [lang for lang, _ in blocks[:2]] == ["bash", "bash"]
    assert blocks[0][1].strip() == DEMO_COMMAND
    assert blocks[1][1].strip() == TEST_COMMAND
    # Nothing but the title and the two commands' one-line captions comes before them.
    head = README.read_text().split("```")[0]
    assert len(head.strip().splitlines()) <= 3


def test_ci_runs_the_readme_test_command():
    assert TEST_COMMAND in (ROOT / ".ci" / "run").read_text()


def test_readme_is_short_and_its_quickstart_comes_early():
    lines = README.read_text().splitlines()
    assert len(lines) <= 200, f"README has {len(lines)} lines"
    _, quickstart = readme_sample("warm_documents")
    assert len(quickstart.strip().splitlines()) <= 20
    first_sample_line = next(i for i, line in enumerate(lines) if line.startswith("```python"))
    assert first_sample_line < 100, f"first Python sample at line {first_sample_line + 1}"


def test_readme_states_the_caveat_before_the_quickstart():
    text = README.read_text()
    caveat = text.find("Answers are not always identical to full prefill")
    assert 0 <= caveat < text.find("## Quickstart")
    assert "reuse=False" in text[caveat : text.find("## Quickstart")]


def test_readme_gives_one_headline_figure_and_the_results_back_it():
    speedups = set(re.findall(r"\b\d+(?:\.\d+)?x\b", README.read_text()))
    assert speedups == {HEADLINE}, f"README speedup figures: {sorted(speedups)}"
    report = HEADLINE_REPORT.read_text()
    assert re.search(rf"TTFT ratio \(full / reuse\)\s*\|\s*median {re.escape(HEADLINE)}", report)
    assert "median 0.89" in report
    assert "corpus_1000_defaults.md" in README.read_text()
    # The benchmarks page names the headline and says where every other speedup comes from.
    benchmarks = (DOCS / "benchmarks.md").read_text()
    assert HEADLINE in benchmarks
    glance = benchmarks.split("## Figures at a glance", 1)[1].split("\n## ", 1)[0]
    rows = [row for row in glance.splitlines() if row.startswith("| ") and not row.startswith("| figure")]
    assert len(rows) >= 5
    for row in rows:
        assert "`" in row.split("|")[3], f"no command for: {row}"


def test_readme_links_every_docs_page():
    text = README.read_text()
    for page in DOCS.glob("*.md"):
        if page.name == "README.md":
            assert "](docs/README.md)" in text
        else:
            assert f"](docs/{page.name}" in text, f"README does not link docs/{page.name}"


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    heading = heading.strip().lower()
    heading = re.sub(r"[^\w\- ]", "", heading)
    return heading.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    seen: dict[str, int] = {}
    found = set()
    for heading in re.findall(r"^#{1,6} (.+)$", text, flags=re.M):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


LINKED_PAGES = [*PAGES, ROOT / "bench" / "README.md", *sorted((ROOT / "integrations").glob("*/README.md"))]


@pytest.mark.parametrize("page", LINKED_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    broken = []
    for link in links:
        if re.match(r"[a-z]+:", link):
            continue
        target, _, anchor = link.partition("#")
        path = (page.parent / target).resolve() if target else page
        if not path.exists():
            broken.append(link)
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(link)
    assert not broken, f"{page.relative_to(ROOT)}: {broken}"


def test_pages_name_no_removed_readme_sections():
    """Pages that used to point at README sections point at the docs pages now."""
    for page in [ROOT / "bench" / "README.md", *(ROOT / "integrations").glob("*/README.md")]:
        text = page.read_text()
        assert "README's \"" not in text, page
        assert "figures are\nin the repository README" not in text, page


# --- the samples run ------------------------------------------------------------------------


def test_samples_found():
    assert len(python_samples(README)) >= 3  # quickstart, LangChain swap, LlamaIndex swap
    # the samples that moved from the README to docs/ are still there to run
    moved = {"api.md": 2, "storage.md": 1, "integrations.md": 2, "tools.md": 1}
    for name, count in moved.items():
        assert len(python_samples(DOCS / name)) >= count, name


@pytest.mark.slow
def test_readme_quickstart_reuses_the_prompt(capsys):
    index, code = readme_sample("warm_documents")
    ns = run_sample(README, index, code)
    full, fast = ns["full"], ns["fast"]
    assert full.kv_reuse_ratio == 0 and full.cached_tokens == 0
    assert fast.prefix_hit_tokens > 0  # the system prompt, exact
    assert fast.content_hit_tokens > 0  # the documents, in another order than warmed
    assert fast.kv_reuse_ratio > 0.5
    assert fast.output_text.strip()
    printed = capsys.readouterr().out
    assert "TTFT" in printed and "of the prompt from cache" in printed


@pytest.mark.slow
def test_readme_langchain_swap(capsys):
    from langchain_kvboost import ChatKVBoost, KVBoostLLM

    index, code = readme_sample("langchain_kvboost")
    ns = run_sample(README, index, code)
    assert isinstance(ns["llm"], KVBoostLLM) and isinstance(ns["chat"], ChatKVBoost)
    assert capsys.readouterr().out.strip()


@pytest.mark.slow
def test_readme_llamaindex_swap(capsys):
    from llama_index.llms.kvboost import KVBoostLLM

    index, code = readme_sample("llama_index.llms.kvboost")
    ns = run_sample(README, index, code)
    assert isinstance(ns["llm"], KVBoostLLM)
    assert capsys.readouterr().out.strip()


DOCS_SAMPLES = [sample for sample in SAMPLES if sample[0] != README]


@pytest.mark.slow
@pytest.mark.parametrize("sample", DOCS_SAMPLES, ids=[sample_id(s) for s in DOCS_SAMPLES])
def test_docs_sample_runs(sample, capsys):
    page, index, code = sample
    run_sample(page, index, code)


def test_the_settings_table_names_every_setting_once():
    """docs/api.md's table of settings by what they govern lists each field of
    ``KVBoostSettings`` in exactly one group, and nothing that is no field."""
    from kvboost_rag.config import KVBoostSettings

    page = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    section = page.split("## Settings by what they govern", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| governs")]
    named = [name for row in rows for name in re.findall(r"`([a-z_]+)`", row.split(" | ", 1)[1])]
    assert sorted(named) == sorted(KVBoostSettings.model_fields), set(named) ^ set(KVBoostSettings.model_fields)
