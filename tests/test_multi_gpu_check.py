"""The multi-device check on 8 fake CPU devices: every mode x sharding of both models
passes its gradient and collective checks and the table is printed (times are host
wall time); the --overlap choices' XLA flags exist in this jaxlib; the HLO parsing."""

import os
import subprocess
import sys

import jax

from jax_cake.tools import multi_gpu_check as mgc

ENV = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
TINY = [
    "--tokens_per_device=40",  # 40 and 320 tokens: no weight width equals a token count
    "--d_model=64",
    "--layers=2",
    "--blocks=1",
    "--d_q=64",
    "--d_kv=16",
    "--d_ff=96",
    "--reps=1",
]


def test_every_mode_and_sharding_passes_on_fake_cpu_devices(tmp_path):
    md = tmp_path / "table.md"
    out = subprocess.run(
        [sys.executable, "-m", "jax_cake.tools.multi_gpu_check", *TINY, f"--md={md}"],
        check=False,
        capture_output=True,
        text=True,
        env=ENV,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "FAIL" not in out.stdout, out.stdout
    for model in ("stack", "llama"):
        for mode in ("shard_map", "auto", "explicit"):
            for sharding in ("dp", "tp", "fsdp"):
                case = f"{model}/{mode}/{sharding}/jax_cake"
                assert f"PASS {case}/grads" in out.stdout, case
                assert f"PASS {case}/no_activation_all_gather" in out.stdout, case
                assert f"| {model} | {mode} | {sharding} | default |" in out.stdout, case
    text = md.read_text()
    assert "host wall time" in text and f"jax {jax.__version__}" in text and "8 x cpu" in text and "--d_model=64" in text
    assert "| model | mode | sharding | overlap | jax_cake ms | XLA ms |" in text
    # the reductions each sharding needs, in jax_cake's compiled steps
    rows = {
        (r.split("|")[1].strip(), r.split("|")[2].strip(), r.split("|")[3].strip()): r
        for r in text.splitlines()
        if r.startswith("| stack")
    }
    assert "all-reduce f32[1,64,64]" in rows[("stack", "auto", "dp")].split("XLA:")[0]  # dw
    assert "all-reduce f32[1,40,64]" in rows[("stack", "auto", "tp")].split("XLA:")[0]  # y and dx
    fsdp = rows[("stack", "auto", "fsdp")].split("XLA:")[0]
    assert "all-gather f32[1,64,64]" in fsdp and "reduce-scatter f32[1,8,64]" in fsdp


def test_overlap_flags_exist_in_this_xla():
    flags = " ".join(sorted({f for v in mgc.OVERLAP.values() for f in v.split()}))
    out = subprocess.run(
        [sys.executable, "-c", "import jax; jax.devices()"],
        check=False,
        capture_output=True,
        text=True,
        env=dict(ENV, XLA_FLAGS=flags),
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]


def test_collectives_parses_tuples_and_async_starts():
    lines = (
        "  %a = (f32[], f32[1,64,64]{2,1,0}, f32[1,64,64]{2,1,0}) all-reduce(%r, %b), channel_id=1",
        "  %g = (bf16[64,64]{1,0}, bf16[128,64]{1,0}) all-gather-start(%p), dimensions={0}",
        "  %d = bf16[128,64]{1,0} all-gather-done(%g)",
        "  %s = f32[8,64]{1,0} reduce-scatter(%y), dimensions={0}",
    )
    calls = mgc.collectives("\n".join(lines))
    assert calls == [
        ("all-reduce", "f32[1,64,64]"),
        ("all-reduce", "f32[1,64,64]"),
        ("all-gather", "bf16[128,64]"),
        ("reduce-scatter", "f32[8,64]"),
    ]
    assert mgc.activation_gathers(calls, (128, 1024)) == ["all-gather bf16[128,64]"]
    assert mgc.activation_gathers(calls, (40, 320)) == []
