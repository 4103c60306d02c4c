"""Real text corpora for the benchmarks, besides Python's reference topics.

Each corpus is ``name -> document`` text found offline on any machine that runs the bench:

- ``stdlib``: the docstrings of standard-library modules, classes and functions
  (``inspect.getdoc``), the long ones only;
- ``packages``: the long descriptions (``METADATA``) of the Python packages installed in the
  running environment, Markdown and reStructuredText as published.

:func:`extractive_questions` asks one question per document whose answer is stated in it (the
words that follow a quoted phrase), so a prompt has one answering document among distractors.
The measures that matter (first-token KL, top-1 and greedy agreement with full prefill, TTFT)
do not depend on the questions being hard.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import inspect
import logging
import random
import re
from collections.abc import Callable

logger = logging.getLogger(__name__)

#: Standard-library modules whose documented objects make the ``stdlib`` corpus.
STDLIB_MODULES: tuple[str, ...] = (
    "argparse", "asyncio", "base64", "bisect", "calendar", "collections", "concurrent.futures",
    "configparser", "contextlib", "csv", "dataclasses", "datetime", "decimal", "difflib", "doctest",
    "email.message", "email.parser", "email.utils", "enum", "fractions", "ftplib", "functools",
    "gettext", "glob", "gzip", "heapq", "hmac", "http.client", "http.cookiejar", "http.server",
    "imaplib", "inspect", "ipaddress", "json", "logging", "logging.handlers", "mailbox", "optparse",
    "pathlib", "pdb", "pickle", "pprint", "queue", "random", "re", "sched", "selectors", "shlex",
    "shutil", "smtplib", "socket", "socketserver", "sqlite3", "statistics", "string", "subprocess",
    "tarfile", "tempfile", "textwrap", "threading", "timeit", "tokenize", "trace", "typing",
    "unittest", "urllib.parse", "urllib.request", "uuid", "warnings", "weakref", "zipfile",
)
#: Shortest document kept (characters), so a document is more than a one-line summary.
MIN_CHARS = 900
_SENTENCE = re.compile(r"[A-Z][^.!?\n]*(?:\n(?!\s*\n)[^.!?\n]*)*[.!?]")
_WORD = re.compile(r"[A-Za-z][A-Za-z'-]+")


def _clean(text: str) -> str:
    """Strip trailing spaces and runs of blank lines."""
    lines = [line.rstrip() for line in text.strip().splitlines()]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines))


@functools.lru_cache(maxsize=1)
def stdlib_docstrings() -> dict[str, str]:
    """Qualified name -> docstring of standard-library modules and their public objects,
    at least :data:`MIN_CHARS` long (duplicates, e.g. re-exported objects, kept once)."""
    docs: dict[str, str] = {}
    seen: set[str] = set()
    for module_name in STDLIB_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:  # a module a build left out (sqlite3, ...)
            continue
        objects: list[tuple[str, object]] = [(module_name, module)]
        for name, obj in sorted(vars(module).items()):
            if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
                continue
            if inspect.isclass(obj) or inspect.isfunction(obj):
                objects.append((f"{module_name}.{name}", obj))
        for qualified, obj in objects:
            text = inspect.getdoc(obj) or ""
            text = _clean(text)
            if len(text) >= MIN_CHARS and text not in seen:
                seen.add(text)
                docs[qualified] = text
    return dict(sorted(docs.items()))


@functools.lru_cache(maxsize=1)
def package_descriptions() -> dict[str, str]:
    """Distribution name -> long description of each installed package with a text one at
    least :data:`MIN_CHARS` long (descriptions mostly markup, links or badges dropped)."""
    docs: dict[str, str] = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata.get("Name")
        body = dist.metadata.get_payload() or dist.metadata.get("Description") or ""
        if not name or name.lower() in docs:
            continue
        text = _clean(body)
        words = len(_WORD.findall(text))
        if len(text) < MIN_CHARS or words < len(text) / 12:  # mostly markup, links or tables
            continue
        docs[name.lower()] = text
    return dict(sorted(docs.items()))


CORPORA: dict[str, Callable[[], dict[str, str]]] = {
    "stdlib": stdlib_docstrings,
    "packages": package_descriptions,
}


def cut(text: str, max_chars: int) -> str:
    """``text`` cut to at most ``max_chars`` characters, on a line break when one is near."""
    if len(text) <= max_chars:
        return text
    end = text.rfind("\n", 0, max_chars)
    return text[: end if end > max_chars // 2 else max_chars].rstrip()


def load_corpus(name: str, doc_chars: int) -> dict[str, str]:
    """The documents of corpus ``name`` cut to ``doc_chars`` characters.

    Raises:
        KeyError: ``name`` is not one of :data:`CORPORA`.
    """
    return {key: cut(text, doc_chars) for key, text in CORPORA[name]().items()}


def extractive_questions(docs: dict[str, str], count: int, rng: random.Random) -> list[tuple[str, str, str]]:
    """Up to ``count`` questions, each answered by one document of ``docs``.

    Each asks for the words that follow a quoted phrase of a sentence of its document (the
    phrase appears once in the whole corpus, so one document answers it).

    Returns:
        ``(document name, question, answer)`` triples, documents in random order.
    """
    everything = " ".join(" ".join(docs.values()).split())  # whitespace normalized
    names = sorted(docs)
    rng.shuffle(names)
    questions = []
    for name in names:
        sentences = [s for s in _SENTENCE.findall(docs[name]) if 10 <= len(s.split()) <= 40]
        rng.shuffle(sentences)
        for sentence in sentences:
            words = " ".join(sentence.split()).split(" ")
            phrase, answer = " ".join(words[:6]), " ".join(words[6:9]).rstrip(".!?,;:")
            if everything.count(phrase) != 1 or not _WORD.search(answer):
                continue
            question = f'In the documents above, which words come right after "{phrase}"?'
            questions.append((name, question, answer))
            break
        if len(questions) >= count:
            break
    return questions
