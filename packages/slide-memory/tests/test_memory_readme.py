"""The README's example runs as written."""

import pathlib
import re


def test_readme_example_runs():
    readme = pathlib.Path(__file__).parents[1] / "README.md"
    (code,) = re.findall(r"```python\n(.*?)```", readme.read_text(), re.S)
    exec(compile(code, str(readme), "exec"), {})
