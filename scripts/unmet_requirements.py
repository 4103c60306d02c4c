"""Which of the given requirements the running Python environment does not meet.

scripts/setup.sh asks this before each install and installs only when something is unmet, so
a second run installs nothing (pip and uv both rebuild and reinstall an editable project
every time they are asked to install it).

Usage: ``python scripts/unmet_requirements.py [--no-deps] ARG...``, each ``ARG`` a requirement
(``name[extras]<specifier>``) or ``-e PATH[extras]``: the project in folder ``PATH``,
installed editable from that folder at the version its ``pyproject.toml`` names. Without
``--no-deps`` the requirements of every distribution met are checked too, down the whole tree
and with the extras asked for. Prints one line per unmet requirement and exits 1 when any is
unmet (or when ``packaging`` is not installed yet, so nothing can be checked), 0 when all are
met.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import tomllib

try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
except ImportError:  # a new environment: nothing is installed, so nothing is met
    print("a new environment (packaging is not installed yet): everything is to install")
    sys.exit(1)

_EDITABLE = re.compile(r"^(?P<path>.+?)(?:\[(?P<extras>[^\]]*)\])?$")


@dataclass(frozen=True)
class Editable:
    """A project folder to be installed editable, with the extras asked for."""

    path: Path
    extras: frozenset[str]

    @classmethod
    def parse(cls, argument: str) -> Editable:
        match = _EDITABLE.match(argument)
        extras = (match["extras"] or "").split(",")
        return cls(Path(match["path"]).resolve(), frozenset(e.strip() for e in extras if e.strip()))

    def project(self) -> dict:
        return tomllib.loads((self.path / "pyproject.toml").read_text())["project"]

    def requirements(self) -> list[Requirement]:
        """The project's dependencies plus those of the extras asked for."""
        project = self.project()
        optional = project.get("optional-dependencies", {})
        lines = list(project.get("dependencies", []))
        for extra in sorted(self.extras):
            lines += optional.get(extra, [])
        return [Requirement(line) for line in lines]


class Environment:
    """The installed distributions, by canonical name (the first found on the path).

    Args:
        path: Folders to look in; ``sys.path`` when not given.
    """

    def __init__(self, path: list[str] | None = None) -> None:
        self.installed: dict[str, metadata.Distribution] = {}
        for dist in metadata.distributions(**({"path": path} if path is not None else {})):
            self.installed.setdefault(canonicalize_name(dist.metadata["Name"] or ""), dist)

    def unmet(self, editables: list[Editable], requirements: list[Requirement], deps: bool) -> list[str]:
        """A line for each requirement not met (and, with ``deps``, each one below them)."""
        problems: list[str] = []
        pending: list[tuple[Requirement, frozenset[str]]] = [(r, frozenset()) for r in requirements]
        for editable in editables:
            problem = self._editable_problem(editable)
            if problem:
                problems.append(problem)
            elif deps:
                pending += [(r, frozenset()) for r in editable.requirements()]
        seen: set[tuple[str, frozenset[str]]] = set()
        while pending:
            requirement, parent_extras = pending.pop()
            if requirement.marker and not any(
                requirement.marker.evaluate({"extra": extra}) for extra in parent_extras or {""}
            ):
                continue
            name = canonicalize_name(requirement.name)
            dist = self.installed.get(name)
            if dist is None:
                problems.append(f"{requirement}: not installed")
                continue
            if not requirement.specifier.contains(dist.version, prereleases=True):
                problems.append(f"{requirement}: {dist.version} installed")
                continue
            key = (name, frozenset(requirement.extras))
            if deps and key not in seen:
                seen.add(key)
                pending += [(Requirement(line), key[1]) for line in dist.requires or []]
        return list(dict.fromkeys(problems))  # once each, wherever the tree meets it

    def _editable_problem(self, editable: Editable) -> str | None:
        project = editable.project()
        dist = self.installed.get(canonicalize_name(project["name"]))
        if dist is None:
            return f"{project['name']} (editable, {editable.path}): not installed"
        direct_url = json.loads(dist.read_text("direct_url.json") or "{}")
        source = direct_url.get("url", "")
        if not direct_url.get("dir_info", {}).get("editable") or source != editable.path.as_uri():
            return f"{project['name']}: not installed editable from {editable.path} ({source or 'an index'})"
        if "version" in project and dist.version != project["version"]:
            return f"{project['name']}: {dist.version} installed, the project is at {project['version']}"
        return None


def parse_arguments(arguments: list[str]) -> tuple[list[Editable], list[Requirement], bool]:
    """Editable projects, requirements, and whether to check dependencies."""
    editables: list[Editable] = []
    requirements: list[Requirement] = []
    deps = True
    words = iter(arguments)
    for word in words:
        if word == "--no-deps":
            deps = False
        elif word == "-e":
            editables.append(Editable.parse(next(words)))
        else:
            requirements.append(Requirement(word))
    return editables, requirements, deps


def main() -> None:
    editables, requirements, deps = parse_arguments(sys.argv[1:])
    problems = Environment().unmet(editables, requirements, deps)
    for problem in problems:
        print(f"to install: {problem}")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
