"""README's Python snippets run as written, in order, in one namespace (on the XLA path
here; the Scaling snippets use the 8 fake CPU devices tests/conftest.py sets up)."""

import pathlib
import re

import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def test_readme_python_snippets_run():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert len(blocks) >= 7, "README lost its snippets"
    scope: dict = {}
    for i, block in enumerate(blocks):
        exec(compile(block, f"README.md python block {i}", "exec"), scope)
    assert scope["dw"].dtype == jnp.float32 and scope["dx"].dtype == jnp.bfloat16
    # 4 micro-batches of ones: each adds sum_t 2 y x = 2 * 256 * 128 to every element.
    assert scope["grads"].dtype == jnp.float32 and scope["grads"].shape == (48, 256)
    assert float(scope["grads"].min()) == float(scope["grads"].max()) == 4 * 2 * 256 * 128
    assert scope["ys"].shape == (4, 128, 512) and scope["ys_per_w"].shape == (4, 128, 512)
    assert scope["y"].dtype == jnp.bfloat16
    assert float(scope["loss"]) == 1024 * 512 * 256  # the Auto-axes step: y = 256 everywhere
    assert scope["y_by_column"].sharding.spec == P(None, "data")
    assert (scope["ys"] == scope["ys_per_w"]).all()
    # H v of 0.5 |x w^T|^2 is v x^T x: with x and v all ones, 512 tokens x 256 = 131072.
    assert scope["hvp"].dtype == jnp.float32 and scope["hvp"].shape == (48, 256)
    assert float(scope["hvp"].min()) == float(scope["hvp"].max()) == 512 * 256
    # the dropless MoE MLP: FP32 gradients of the FP32 master experts, and of the routing weights
    assert [g.dtype for g in scope["moe_grads"][0]] == [jnp.float32] * 3
    assert scope["moe_grads"][1].dtype == jnp.float32 and scope["moe_grads"][1].shape == (64, 2)
