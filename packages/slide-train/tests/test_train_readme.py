"""The README's Python API example runs as written (in a temporary working directory)."""

import pathlib
import re


def test_readme_python_api_example_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    readme = pathlib.Path(__file__).parents[1] / "README.md"
    (code,) = re.findall(r"```python\n(.*?)```", readme.read_text(), re.S)
    exec(compile(code, str(readme), "exec"), {})
    assert (tmp_path / "runs" / "api-demo" / "export" / "config.json").is_file()
