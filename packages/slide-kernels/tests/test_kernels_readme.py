"""The README's first example runs as written (here on the torch path, or the interpreter on CI)."""

import pathlib
import re


def test_readme_example_runs():
    readme = pathlib.Path(__file__).parents[1] / "README.md"
    code = re.findall(r"```python\n(.*?)```", readme.read_text(), re.S)[0]
    scope: dict = {}
    exec(compile(code, str(readme), "exec"), scope)
    assert scope["loss"].ndim == 0 and scope["hidden"].grad is not None
    assert scope["q"].shape == (2, 4, 7, 16) and scope["act"].shape == (2, 7, 128)
