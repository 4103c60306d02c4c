"""Install the lowest versions the packages admit into an overlay folder (for PYTHONPATH).

Reads the lower bounds of ``transformers`` (the engine's pyproject.toml), ``langchain-core``
and ``llama-index-core`` (the integrations' pyproject.toml files) and installs exactly those
versions with ``--no-deps`` into ``DIR``; where the lowest transformers pins ``tokenizers`` or
``huggingface-hub`` to versions the environment does not have, the newest version it admits
goes into ``DIR`` too. Everything else comes from the environment.

Usage: ``python scripts/lowest_versions.py DIR``; prints ``name==version`` of each package
installed, and exits non-zero when a bound is missing or an install fails.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import tomllib
from packaging.requirements import Requirement

logger = logging.getLogger("lowest_versions")
ROOT = Path(__file__).resolve().parent.parent
#: Package -> the pyproject.toml whose dependencies bound it.
BOUNDED = {
    "transformers": ROOT / "pyproject.toml",
    "langchain-core": ROOT / "integrations/langchain-kvboost/pyproject.toml",
    "llama-index-core": ROOT / "integrations/llama-index-llms-kvboost/pyproject.toml",
}
#: transformers' dependencies whose pins follow its version.
PINNED_BY_TRANSFORMERS = ("tokenizers", "huggingface-hub")


def lowest(name: str, pyproject: Path) -> str:
    """The version named by the ``>=`` bound of ``name`` in ``pyproject``'s dependencies."""
    for line in tomllib.loads(pyproject.read_text())["project"]["dependencies"]:
        requirement = Requirement(line)
        if requirement.name == name:
            bounds = [spec.version for spec in requirement.specifier if spec.operator == ">="]
            if bounds:
                return bounds[0]
    raise SystemExit(f"{pyproject} has no '>=' bound for {name}")


def pip_install(target: Path, *requirements: str) -> None:
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    subprocess.run([*command, "--no-deps", "--upgrade", "--target", str(target), *requirements], check=True)


def follow_transformers_pins(target: Path) -> list[str]:
    """``tokenizers`` / ``huggingface-hub`` requirements of the installed lowest transformers
    that the environment's versions do not meet."""
    dist = next(metadata.distributions(path=[str(target)], name="transformers"))
    needed = []
    for line in dist.requires or []:
        requirement = Requirement(line)
        if requirement.name not in PINNED_BY_TRANSFORMERS or requirement.marker is not None:
            continue
        if metadata.version(requirement.name) not in requirement.specifier:
            needed.append(str(requirement))
    return needed


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    target = Path(sys.argv[1]).resolve()
    pins = [f"{name}=={lowest(name, pyproject)}" for name, pyproject in BOUNDED.items()]
    pip_install(target, *pins)
    extra = follow_transformers_pins(target)
    if extra:
        pip_install(target, *extra)
    for dist in metadata.distributions(path=[str(target)]):
        logger.info("%s==%s", dist.metadata["Name"], dist.version)


if __name__ == "__main__":
    main()
