"""The default corpus: Python's own reference documentation (``pydoc_data.topics``).

It ships with every CPython install, so demos, tests and benchmarks have real text offline.
"""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=1)
def python_reference_topics() -> dict[str, str]:
    """Topic name -> reference text, for the 79 topics of ``pydoc_data.topics``."""
    from pydoc_data.topics import topics

    return {name: text.strip() for name, text in sorted(topics.items()) if text.strip()}


def python_reference_documents(max_chars: int | None = None) -> list[str]:
    """The reference topics as a list of documents, optionally cut to ``max_chars`` each.

    Args:
        max_chars: Cut each document to at most this many characters (on a line break when
            one is near), so several fit one prompt of a small model.
    """
    docs = list(python_reference_topics().values())
    if max_chars is None:
        return docs
    cut: list[str] = []
    for doc in docs:
        if len(doc) <= max_chars:
            cut.append(doc)
            continue
        end = doc.rfind("\n", 0, max_chars)
        cut.append(doc[: end if end > max_chars // 2 else max_chars].rstrip())
    return cut
