"""Every Python code sample in the README runs."""

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

README = Path(__file__).resolve().parents[1] / "README.md"
SAMPLES = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_samples():
    assert SAMPLES


@pytest.mark.parametrize("index", range(len(SAMPLES)))
def test_readme_sample_runs(index, capsys):
    exec(compile(SAMPLES[index], f"README.md sample {index}", "exec"), {"__name__": "__readme__"})
