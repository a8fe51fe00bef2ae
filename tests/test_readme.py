"""README's usage example runs as written (on the XLA path here)."""

import pathlib
import re

import jax.numpy as jnp

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def test_readme_usage_example_runs():
    block = re.search(r"## Usage\n\n```python\n(.*?)```", README.read_text(), re.S).group(1)
    scope: dict = {}
    exec(compile(block, "README.md usage", "exec"), scope)
    assert scope["dw"].dtype == jnp.float32 and scope["dx"].dtype == jnp.bfloat16
