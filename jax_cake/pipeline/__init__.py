"""The pipelines under the public ops: validated operands -> plans -> one custom_vjp ->
the GEMM primitives.

  validation.py  the operand checks of every public entry point, with their messages
  projection.py  the projection (dense, batched, Flax layout) and its epilogue options
  fused.py       several weights over one input, one GEMM per pass
  gated.py       the gated (SwiGLU / GeGLU) projection: the forward GEMM's gated epilogue
  router.py      the FP32 router GEMM (BF16x3)
  grouped.py     the grouped (ragged) projection of MoE experts: one weight per group of rows,
                 and its gated option (grouped_gated_projection)
  moe.py         the dropless MoE expert MLP (moe_mlp): routing, the grouped GEMMs, the combine
"""
