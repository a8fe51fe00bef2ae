"""Plan-table rows that record XLA's dot as faster: plan() picks the XLA path exactly in
the row's range, for fwd, dgrad and wgrad, under both values of `deterministic`; explain
says why; values, gradients, remat names and the CUDA lowering follow."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_cake as jc
from jax_cake.planner import tables
from helpers import H200, rand, cuda_text

H100 = jax.sharding.AbstractDevice("NVIDIA H100", 114, "cuda")
SOURCE = "jax_cake.tools.tune 2026-12-02 on NVIDIA H200 (132 SMs)"


def xla_row(op, d_in=4096, d_out=96, out="bfloat16", lo=16172, hi=16384, exclude=(), ratio=0.91, **extra):
    return dict(
        op=op,
        d_in=d_in,
        d_out=d_out,
        out=out,
        min_tokens=lo,
        max_tokens=hi,
        program="xla",
        exclude_tokens=list(exclude),
        source=SOURCE,
        ratio=ratio,
        **extra,
    )


def table_of(*rows, sms=132):
    return tables.parse({"arch": "sm_90a", "sm_ranges": [{"min_sms": sms, "max_sms": sms, "rows": list(rows)}]})


def plan_at(op, tokens, d_in=4096, d_out=96, out="bfloat16", deterministic=True, device=H200, batch=1):
    return jc.plan(
        op,
        tokens=tokens,
        d_in=d_in,
        d_out=d_out,
        out_dtype=out,
        deterministic=deterministic,
        device=device,
        batch=batch,
    )


# --- plan(): exactly the row's range ---------------------------------------------------------


@pytest.mark.parametrize(
    "op,out", [("fwd", "bfloat16"), ("dgrad", "bfloat16"), ("wgrad", "float32"), ("wgrad", "bfloat16")]
)
@pytest.mark.parametrize("deterministic", [True, False])
def test_xla_row_picks_xla_exactly_in_its_range(op, out, deterministic):
    table = table_of(xla_row(op, out=out, lo=16172, hi=16384, exclude=[16231]))
    with tables.use_table(table):
        inside = [plan_at(op, t, out=out, deterministic=deterministic) for t in (16172, 16300, 16384)]
        outside = [
            plan_at(op, 16231, out=out, deterministic=deterministic),  # excluded
            plan_at(op, 16171, out=out, deterministic=deterministic),  # below
            plan_at(op, 16385, out=out, deterministic=deterministic),  # above
            plan_at(op, 16384, d_out=128, out=out, deterministic=deterministic),  # another width
            plan_at(op, 16384, d_in=5120, out=out, deterministic=deterministic),
            plan_at(op, 16384, out=out, deterministic=deterministic, batch=2),  # rows are batch 1 unless they say
            plan_at(op, 16384, out=out, deterministic=deterministic, device=H100),  # another SM count
        ]
        others = [o for o in ("fwd", "dgrad", "wgrad") if o != op]
        # fwd and dgrad write bf16 only (the wgrad bf16 case checks that the op tells rows apart)
        other_ops = [plan_at(o, 16384, out=out if o == "wgrad" else "bfloat16", deterministic=deterministic) for o in others]
    for p in inside:
        assert p.backend == "xla" and not p.uses_kernel and p.program is None, jc.explain(p)
        assert p.deterministic
        assert "records XLA's dot faster here" in p.reason and SOURCE in p.reason and "0.910" in p.reason
    for p in outside + other_ops:
        assert p.uses_kernel and p.algorithm == "det", jc.explain(p)
    if op == "wgrad" and not deterministic:  # the wgrad plan names the table's verdict
        assert "excluded" in outside[0].reason


def test_other_out_dtype_keeps_the_kernel():
    with tables.use_table(table_of(xla_row("wgrad", out="float32"))):
        assert not plan_at("wgrad", 16384, out="float32").uses_kernel
        assert plan_at("wgrad", 16384, out="bfloat16").uses_kernel


def test_explain_says_why():
    with tables.use_table(table_of(xla_row("dgrad"))):
        text = jc.explain(plan_at("dgrad", 16384))
    assert "runs the XLA path" in text
    assert "the sm_90a plan table (132 SMs, dgrad 4096 -> 96 bfloat16, tokens 16172..16384)" in text
    assert f"records XLA's dot faster here ({SOURCE}: median time ratio 0.910)" in text


def test_forced_programs_win_over_the_table():
    """The benchmark's and the tuner's det / split arms must time the kernels."""
    with tables.use_table(table_of(xla_row("wgrad", out="float32"), xla_row("fwd"))):
        with jc.planner.force("det"):
            assert plan_at("wgrad", 16384, out="float32").uses_kernel
            assert plan_at("fwd", 16384).uses_kernel
        with jc.planner.force("split"):
            assert plan_at("wgrad", 16384, out="float32", deterministic=False).algorithm == "split"


def test_split_row_first_serves_deterministic_false_only():
    """A split row before an xla row: deterministic=False runs split, True skips split
    rows and takes the xla row; an xla row first wins for both."""
    split = dict(
        d_in=4096, d_out=96, out="float32", min_tokens=16384, max_tokens=16384, program="split", source="synthetic"
    )
    with tables.use_table(table_of(split, xla_row("wgrad", out="float32"))):
        assert plan_at("wgrad", 16384, out="float32", deterministic=False).algorithm == "split"
        assert not plan_at("wgrad", 16384, out="float32", deterministic=True).uses_kernel
    with tables.use_table(table_of(xla_row("wgrad", out="float32"), split)):
        assert not plan_at("wgrad", 16384, out="float32", deterministic=False).uses_kernel
        assert not plan_at("wgrad", 16384, out="float32", deterministic=True).uses_kernel


def test_batched_row_and_legacy_rows():
    with tables.use_table(table_of(xla_row("fwd", d_in=128, d_out=512, lo=4096, hi=4096, batch=16))):
        assert not plan_at("fwd", 4096, d_in=128, d_out=512, batch=16).uses_kernel
        assert plan_at("fwd", 4096, d_in=128, d_out=512, batch=8).uses_kernel
    legacy = tables.parse(
        {
            "arch": "sm_90a",
            "sm_ranges": [
                {
                    "min_sms": 132,
                    "max_sms": 132,
                    "rows": [dict(d_in=8, d_out=8, out="float32", min_tokens=1, max_tokens=2, program="split")],
                }
            ],
        }
    )
    (row,) = legacy.sm_ranges[0].rows
    assert (row.op, row.batch, row.ratio) == ("wgrad", 1, None)


@pytest.mark.parametrize(
    "row,words",
    [
        (dict(op="router_fwd"), "op 'router_fwd'"),
        (dict(op="fwd", program="split"), "cannot run the split program"),
        (dict(program="fast"), "program 'fast'"),
    ],
)
def test_bad_rows_fail_loudly(row, words):
    with pytest.raises(ValueError, match=words):
        table_of({**xla_row("wgrad"), **row})


# --- the shipped tables: xla rows only within the accuracy contract --------------------------


def _shipped():
    """(file name, SM range, its rows' JSON) of every shipped plan table."""
    import json
    import pathlib

    out = []
    for path in sorted((pathlib.Path(tables.__file__).parent / "tables").glob("*.json")):
        for rng in json.loads(path.read_text())["sm_ranges"]:
            out.append((path.name, rng))
    return out


def test_shipped_xla_rows_meet_the_accuracy_contract():
    """An xla row replaces the kernel, so XLA must meet the op's accuracy contract there.
    An FP32 output (the FP32 dw) needs XLA's measured error on the row, under 1e-5: XLA's
    FP32-output dot sums K in one level (1.86e-5 at T 16384, 4096 -> 4096 on the H200),
    where jax_cake's two-level sum gives 2-5e-6. A BF16 output is rounded once to BF16 by
    XLA as by the kernel; a recorded error must be under 1e-2."""
    from benchmarks import plan_rule

    checked = 0
    for name, rng in _shipped():
        for row in rng["rows"]:
            if row["program"] != "xla":
                continue
            op, out = row.get("op", "wgrad"), row["out"]
            limit = plan_rule.rel_err_max(op, out)
            where = f"{name} {rng['min_sms']} SMs {op} {row['d_in']} -> {row['d_out']} {out} T {row['min_tokens']}"
            if out == "float32":
                assert row.get("rel_err") is not None, f"{where}: an FP32 xla row without XLA's measured error"
            if row.get("rel_err") is not None:
                assert row["rel_err"] < limit and row.get("rel_err_max") == limit, where
            checked += 1
    assert checked  # the sm_90a table's fwd rows


def test_shipped_sm90a_keeps_the_kernel_for_fp32_dw_and_xla_for_its_rows():
    """The FP32-wgrad xla rows without a measured error within the contract left the sm_90a
    table (into its dropped list, which the planner does not read): the H200 plans its
    kernel there under both `deterministic`. The xla rows (BF16 forwards and input
    gradients, and FP32 wgrads re-measured within 1e-5) send their points to XLA."""
    ((_, rng),) = [(n, r) for n, r in _shipped() if n == "sm_90a.json"]
    dropped = rng["dropped"]
    assert {(d["op"], d["out"], d["program"]) for d in dropped} == {("wgrad", "float32", "xla")}
    measured = {(d["d_out"], d["tokens"]): d["rel_err"] for d in dropped if d["rel_err"] is not None}
    assert measured == {(4096, 16384): 1.86e-5, (1024, 16384): 1.86e-5}
    for d in dropped:
        for deterministic in (True, False):
            p = plan_at("wgrad", d["tokens"], d_in=d["d_in"], d_out=d["d_out"], out="float32", deterministic=deterministic)
            assert p.uses_kernel, jc.explain(p)
    rows = [r for r in rng["rows"] if r["program"] == "xla"]
    assert {(r["op"], r["out"]) for r in rows} == {("fwd", "bfloat16"), ("dgrad", "bfloat16"), ("wgrad", "float32")}
    for r in rows:
        if r["op"] == "wgrad":
            assert r["rel_err"] is not None and r["rel_err"] < r["rel_err_max"] == 1e-5, r
        p = plan_at(r["op"], r["min_tokens"], d_in=r["d_in"], d_out=r["d_out"], out=r["out"])
        assert not p.uses_kernel and "records XLA's dot faster here" in p.reason


# --- what runs: values, gradients, lowering, remat ------------------------------------------


def _loss_and_grads(deterministic):
    def loss(x, w):
        y = jc.dense_projection(x, w, deterministic=deterministic)
        return jnp.sum(y.astype(jnp.float32) * jnp.cos(jnp.arange(y.shape[-1], dtype=jnp.float32)))

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


@pytest.mark.parametrize("w_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("deterministic", [True, False])
def test_values_and_grads_equal_the_kernel_less_reference(monkeypatch, w_dtype, deterministic):
    """Planned for an H200 (the trace's device lookup faked) but run on the CPU: the
    table's xla rows make every GEMM an XLA plan, and the values and gradients equal the
    kernel-less run and reference.py's FP32-accumulating dots bit for bit."""
    from jax_cake import reference
    from jax_cake.pipeline import projection
    from jax_cake.planner import device as device_lib

    t, d_in, d_out = 96, 64, 48
    x, w = rand(0, (t, d_in), jnp.bfloat16), rand(1, (d_out, d_in), w_dtype)
    out = jnp.dtype(w_dtype).name
    want = _loss_and_grads(deterministic)(x, w)  # CPU: the XLA path everywhere, no table involved

    ops = (("fwd", "bfloat16"), ("dgrad", "bfloat16"), ("wgrad", out))
    rows = [xla_row(op, d_in=d_in, d_out=d_out, out=o, lo=t, hi=t) for op, o in ops]
    h200 = device_lib.DeviceInfo("cuda", "NVIDIA H200", "sm_90a", 132)
    monkeypatch.setattr(device_lib, "current", lambda *args: h200)
    seen = []
    make_plan = projection.make_plan
    monkeypatch.setattr(projection, "make_plan", lambda *a, **k: seen.append(make_plan(*a, **k)) or seen[-1])
    with tables.use_table(table_of(*rows)):
        got = _loss_and_grads(deterministic)(x, w)
    assert {p.op for p in seen} == {"fwd", "dgrad", "wgrad"}
    assert all(p.backend == "xla" and "records XLA's dot faster here" in p.reason for p in seen), seen

    assert got[1][1].dtype == w_dtype
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(g.astype(jnp.float32)), np.asarray(r.astype(jnp.float32)))
    dy = jax.grad(lambda y: jnp.sum(y.astype(jnp.float32) * jnp.cos(jnp.arange(d_out, dtype=jnp.float32))))(
        jnp.zeros((t, d_out), jnp.bfloat16)
    )
    w16 = w.astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(got[1][0]), np.asarray(reference.dgrad(dy[None], w16[None])[0]))
    # dw: the FP32-output dot, rounded once to w's dtype
    dw = jax.lax.dot_general(dy, x, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32).astype(w_dtype)
    np.testing.assert_array_equal(np.asarray(got[1][1]), np.asarray(dw))


def test_cuda_lowering_runs_xla_only_for_the_row_op():
    spec = jax.ShapeDtypeStruct

    def step(x, w):
        loss = lambda x, w: jnp.sum(jc.dense_projection(x, w).astype(jnp.float32) ** 2)
        return jax.grad(loss, argnums=(0, 1))(x, w)

    args = (spec((16384, 4096), jnp.bfloat16), spec((96, 4096), jnp.float32))
    with tables.use_table(table_of(xla_row("wgrad", out="float32"))):
        text = cuda_text(step, *args)
    assert "custom_call @jax_cake_fwd(" in text and "custom_call @jax_cake_dgrad(" in text
    assert "custom_call @jax_cake_wgrad(" not in text
    dots = [line for line in text.splitlines() if "dot_general" in line]
    assert len(dots) == 1 and "-> tensor<1x96x4096xf32>" in dots[0]  # the FP32-output dot


@pytest.mark.parametrize("policy,xla_fwds", [(None, 2), (jc.remat.save_projections, 1)])
def test_remat_policy_saves_the_xla_output_by_name(policy, xla_fwds):
    """The XLA-path output keeps its checkpoint name: save_projections saves it, a plain
    checkpoint recomputes it in the backward."""

    def block(x, w1, w2):
        return jc.dense_projection(jax.nn.gelu(jc.dense_projection(x, w1)), w2)

    block = jax.checkpoint(block, policy=policy)
    grad = jax.grad(lambda x, w1, w2: jnp.sum(block(x, w1, w2).astype(jnp.float32) ** 2), argnums=(1, 2))
    spec = jax.ShapeDtypeStruct
    args = (spec((1024, 256), jnp.bfloat16), spec((512, 256), jnp.float32), spec((256, 512), jnp.float32))
    with tables.use_table(table_of(xla_row("fwd", d_in=256, d_out=512, lo=1024, hi=1024))):
        text = cuda_text(grad, *args)
    fwd_dots = [line for line in text.splitlines() if "dot_general" in line and "-> tensor<1x1024x512xbf16>" in line]
    assert len(fwd_dots) == xla_fwds, text
    assert text.count("custom_call @jax_cake_fwd(") == 1  # the second layer: its kernel, run once
