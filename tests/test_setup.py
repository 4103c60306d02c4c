"""What scripts/setup.sh relies on to install nothing on a second run, and to take seconds:
scripts/unmet_requirements.py, asked before each install (here on folders of hand-made
distributions: no install, no network), and a look for the converted embedded model that
imports neither torch nor transformers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from unmet_requirements import Environment, parse_arguments  # noqa: E402


def distribution(site: Path, name: str, version: str, requires: tuple[str, ...] = (), editable_from: Path | None = None) -> None:
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}", *(f"Requires-Dist: {r}" for r in requires)]
    (info / "METADATA").write_text("\n".join(lines) + "\n")
    if editable_from is not None:
        (info / "direct_url.json").write_text(json.dumps({"url": editable_from.as_uri(), "dir_info": {"editable": True}}))


def project(folder: Path, name: str, version: str, dependencies: list[str], extras: dict[str, list[str]]) -> Path:
    folder.mkdir(parents=True)
    optional = "".join(f"{extra} = {json.dumps(lines)}\n" for extra, lines in extras.items())
    (folder / "pyproject.toml").write_text(
        f'[project]\nname = "{name}"\nversion = "{version}"\ndependencies = {json.dumps(dependencies)}\n'
        f"[project.optional-dependencies]\n{optional}"
    )
    return folder


def unmet(site: Path, *arguments: str) -> list[str]:
    editables, requirements, deps = parse_arguments(list(arguments))
    return Environment(path=[str(site)]).unmet(editables, requirements, deps)


@pytest.fixture
def site(tmp_path: Path) -> Path:
    site = tmp_path / "site"
    distribution(site, "torch", "2.13.0+cpu", ("sympy>=1.13",))
    distribution(site, "sympy", "1.14.0", ("mpmath<1.4,>=1.1.0",))
    distribution(site, "mpmath", "1.3.0")
    distribution(site, "ray", "2.50.0", ('fastapi; extra == "serve"', 'pywin32; sys_platform == "win32"'))
    return site


def test_met_down_the_tree_and_a_local_build_meets_its_version(site: Path):
    assert unmet(site, "torch==2.13.0", "sympy>=1.13") == []


def test_a_missing_or_older_distribution_is_unmet_wherever_it_sits(site: Path):
    assert unmet(site, "torch==2.12.0") == ["torch==2.12.0: 2.13.0+cpu installed"]
    assert unmet(site, "redis>=5") == ["redis>=5: not installed"]
    (site / "mpmath-1.3.0.dist-info" / "METADATA").unlink()
    (site / "mpmath-1.3.0.dist-info").rmdir()
    assert unmet(site, "torch==2.13.0") == ["mpmath<1.4,>=1.1.0: not installed"]
    assert unmet(site, "--no-deps", "torch==2.13.0") == []


def test_an_extra_asks_for_its_own_requirements_only(site: Path):
    assert unmet(site, "ray>=2.9") == []  # neither fastapi (an extra) nor pywin32 (Windows)
    assert unmet(site, "ray[serve]>=2.9") == ['fastapi; extra == "serve": not installed']


def test_an_editable_project_is_checked_against_its_pyproject(site: Path, tmp_path: Path):
    folder = project(tmp_path / "engine", "engine", "0.2.0", ["torch>=2.4"], {"extra": ["redis>=5"]})
    assert unmet(site, "-e", str(folder)) == [f"engine (editable, {folder}): not installed"]
    distribution(site, "engine", "0.2.0", editable_from=folder)
    assert unmet(site, "-e", str(folder)) == []
    # a dependency the pyproject gained after the install, through an extra
    assert unmet(site, "-e", f"{folder}[extra]") == ["redis>=5: not installed"]
    assert unmet(site, "--no-deps", "-e", f"{folder}[extra]") == []


def test_an_editable_from_elsewhere_or_at_another_version_is_unmet(site: Path, tmp_path: Path):
    folder = project(tmp_path / "engine", "engine", "0.3.0", [], {})
    other = tmp_path / "other-clone"
    distribution(site, "engine", "0.3.0", editable_from=other)
    assert unmet(site, "-e", str(folder)) == [f"engine: not installed editable from {folder} ({other.as_uri()})"]
    bumped = project(tmp_path / "bumped" / "engine", "engine", "0.4.0", [], {})
    distribution(tmp_path / "site2", "engine", "0.3.0", editable_from=bumped)
    assert unmet(tmp_path / "site2", "-e", str(bumped)) == ["engine: 0.3.0 installed, the project is at 0.4.0"]


def test_finding_the_converted_model_imports_neither_torch_nor_transformers(tmp_path: Path):
    code = (
        "import sys; from kvboost_rag.default_model import cache_home; import kvboost_rag; "
        "print(sorted(m for m in ('torch', 'transformers', 'pydantic') if m in sys.modules), cache_home()); "
        "print(kvboost_rag.KVBoostSettings.__module__, 'pydantic' in sys.modules)"
    )
    env = {**os.environ, "KVBOOST_RAG_HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout
    assert out.splitlines() == [f"[] {tmp_path}", "kvboost_rag.config True"]
