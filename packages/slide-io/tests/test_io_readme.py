"""The README's example runs as written."""

from __future__ import annotations

import pathlib
import re


def test_readme_example_runs():
    text = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S)
    assert code is not None
    exec(compile(code.group(1), "README.md", "exec"), {})
