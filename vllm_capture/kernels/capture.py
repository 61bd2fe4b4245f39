"""One launch per call site per step: the capture kernel and its Python launcher.

Why it looks the way it does (see ``docs/architecture.md`` and the vLLM integration note, 3.5):

* **Graph replay runs no Python.** Under CUDA graphs the op's Python body runs once, at capture
  time; replays re-issue the recorded launch with the recorded arguments. So everything that
  changes per step (mode, count, ring offset, rows, labels) is *read by the kernel from device memory*
  (``plan_meta``, ``plan``, ``site``), which the host rewrites between steps.
* **Static addresses.** The recorded launch holds raw pointers: every buffer passed here must be
  allocated before capture and never reallocated (``x`` and ``residual`` are graph-internal
  tensors at static addresses per graph, which is fine).
* **No host sync, no data-dependent launch parameters.** The grid depends only on ``x.shape[0]``
  (the padded token count, fixed per captured graph) and fixed capacities; the dynamic row or
  segment count is read on the device and surplus programs exit at once. ``.item()``-style reads
  would raise during capture (vLLM captures with ``capture_error_mode="global"``). An eager
  launch runs once, for the step whose plan the host just wrote: its grid covers that plan's
  entries only (``entries``).
* **One launch per site.** Launch overhead is what a per-layer op costs at decode, so a single
  kernel dispatches on the mode read from ``plan_meta`` instead of one launch per mode.
* **No recompiles.** Size and stride arguments are ``do_not_specialize`` (and the pointers of
  views handed over by Inductor are not specialised on alignment), so a new ``T`` or a new view
  offset does not trigger a JIT compile; there is no autotuning. :func:`warmup` compiles every
  variant (one per dtype combination and residual presence) before graph capture, which vLLM's
  JIT monitor expects.
* **Eager launches skip the JIT's dispatch.** Outside graphs (a prefill larger than the largest
  captured graph, ``enforce_eager``) the op body launches, every forward, at every enabled site
  whose stream has rows planned in the step; Triton's JIT spends most of such a launch binding
  and specializing arguments. :func:`launch_kernel` keeps the kernel the JIT returned per
  specialization and calls its launcher directly.
* **Strides.** Inductor may hand over non-contiguous views; the kernel takes ``x``/``residual``
  strides explicitly.
* **The replay counter.** ``site[SITE_EXECUTIONS]`` is incremented by exactly one program per
  launch, whether or not anything is captured, so the host can count forwards (graph replays
  included) without running Python per step.
"""

from __future__ import annotations

from typing import Iterable

import torch

from . import layout as L
from .accumulate import accumulate_reference
from .common import HAVE_TRITON, tl, triton
from .gather import gather_rows_reference

#: plan entries (rows, or segments) per program along grid axis 0.
BLOCK_R = 16
#: columns per program along grid axis 1.
BLOCK_W = 64
#: rows in flight per iteration when summing a long segment (MODE_MEAN).
BLOCK_T = 64
#: MODE_MEAN segments of at most this many rows are summed together, one row per iteration.
MEAN_SHORT = 16
#: warps per program (no autotuning: a fixed, small configuration).
NUM_WARPS = 8
#: steps of at most this many (padded) tokens load row ``e`` alongside plan entry ``e``
#: (decode: entry ``e`` is row ``e``); 0 turns that off. A bound, because a step of ``T`` tokens
#: then reads ``T`` rows where it needs one per request.
SPEC_ROWS = 256

if HAVE_TRITON:
    from .accumulate import accumulate_segments_tile
    from .common import load_rows_f32
    from .gather import gather_rows_tile

    _MODE_ROWS = tl.constexpr(L.MODE_ROWS)
    _MODE_LAST = tl.constexpr(L.MODE_LAST)
    _MODE_MEAN = tl.constexpr(L.MODE_MEAN)
    _META_MODE = tl.constexpr(L.META_MODE)
    _META_COUNT = tl.constexpr(L.META_COUNT)
    _META_OFFSET = tl.constexpr(L.META_OFFSET)
    _META_STEP = tl.constexpr(L.META_STEP)
    _SITE_EXECUTIONS = tl.constexpr(L.SITE_EXECUTIONS)
    _SITE_ENABLED = tl.constexpr(L.SITE_ENABLED)
    _PLAN_FIELDS = tl.constexpr(L.PLAN_FIELDS)
    _NO_TOKEN = tl.constexpr(L.NO_TOKEN)

    _SIZE_ARGS = ["T", "W", "cap", "ring_rows", "acc_slots", "n_ids", "spec_rows",
                  "stride_xt", "stride_xw", "stride_rt", "stride_rw", "stride_ids"]
    _UNALIGNED_ARGS = ["x_ptr", "res_ptr", "ids_ptr"]

    @triton.jit(do_not_specialize=_SIZE_ARGS, do_not_specialize_on_alignment=_UNALIGNED_ARGS)
    def capture_site_kernel(
        x_ptr, res_ptr, ids_ptr, meta_ptr, plan_ptr, site_ptr,
        ring_ptr, ring_labels_ptr, acc_ptr, acc_labels_ptr, acc_count_ptr,
        T, W, cap, ring_rows, acc_slots, n_ids, spec_rows,
        stride_xt, stride_xw, stride_rt, stride_rw, stride_ids,
        HAS_RES: tl.constexpr, UNIT_W: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr,
        BLOCK_T: tl.constexpr, SHORT: tl.constexpr,
    ):
        """grid = (max(1, cdiv(min(T, cap), BLOCK_R)), max(1, cdiv(W, BLOCK_W))); eager launches
        may bound min(T, cap) by the step's plan count as well (:func:`capture_grid`).

        Program (0, 0) bumps the execution counter; every program then reads ``enabled``, the
        step's ``plan_meta`` and its own plan entries, and leaves unless there is work for its
        tile. Those reads are all issued at once, before any of them is known: a step's capture
        costs two dependent memory round trips (plan, then rows), where reading each value only
        once the previous one allowed it cost five, and at decode a site's launch is mostly
        waiting. A step of at most ``spec_rows`` tokens also reads rows ``e`` of its tile (and
        their token ids) in that first round: at decode the plan's entry ``e`` is row ``e`` (every
        request one token, in batch order), and the tiles use those values wherever the plan
        agrees, so such a step costs one round trip; entries the plan puts elsewhere are still
        read after the plan. The atomics are relaxed: nothing in the kernel waits for them, and
        the host reads the counters after the step.
        """
        pid_r = tl.program_id(0)
        pid_w = tl.program_id(1)
        if (pid_r == 0) & (pid_w == 0):
            tl.atomic_add(site_ptr + _SITE_EXECUTIONS, 1, sem="relaxed")
        enabled = tl.load(site_ptr + _SITE_ENABLED)
        mode = tl.load(meta_ptr + _META_MODE)
        count = tl.load(meta_ptr + _META_COUNT)
        offset = tl.load(meta_ptr + _META_OFFSET)
        step = tl.load(meta_ptr + _META_STEP)
        # The program's plan entries, fields 0-3 (PLAN_ROW/REQ/POS or PLAN_SEG_START/COUNT/SLOT/
        # REQ, by mode); within the plan's capacity, whatever the mode and count turn out to be.
        e = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
        e_ok = e < tl.minimum(T, cap)
        plan0 = tl.load(plan_ptr + e * _PLAN_FIELDS + 0, mask=e_ok, other=-1)
        plan1 = tl.load(plan_ptr + e * _PLAN_FIELDS + 1, mask=e_ok, other=0)
        plan2 = tl.load(plan_ptr + e * _PLAN_FIELDS + 2, mask=e_ok, other=-1)
        plan3 = tl.load(plan_ptr + e * _PLAN_FIELDS + 3, mask=e_ok, other=0)
        cols = pid_w * BLOCK_W + tl.arange(0, BLOCK_W)
        spec_ok = e_ok & (T <= spec_rows)
        e64 = e.to(tl.int64)
        spec_x = load_rows_f32(x_ptr, res_ptr, e64[:, None], cols.to(tl.int64)[None, :],
                               spec_ok[:, None] & (cols < W)[None, :],
                               stride_xt, stride_xw, stride_rt, stride_rw, HAS_RES, UNIT_W)
        spec_tok = tl.load(ids_ptr + e64 * stride_ids, mask=spec_ok & (e < n_ids) & (pid_w == 0),
                           other=_NO_TOKEN)
        if enabled != 0:
            if mode == _MODE_ROWS:
                # A repeated step's rows follow the last one's, each a position further.
                first = offset + step * count
                n = tl.minimum(tl.minimum(tl.maximum(count, 0), tl.minimum(T, cap)),
                               ring_rows - first)
                if (pid_r * BLOCK_R < n) & (first >= 0):
                    gather_rows_tile(
                        x_ptr, res_ptr, ids_ptr, ring_ptr, ring_labels_ptr,
                        plan0, plan1, plan2 + step, spec_ok, spec_x, spec_tok,
                        n, first, T, W, n_ids,
                        stride_xt, stride_xw, stride_rt, stride_rw, stride_ids,
                        pid_r, pid_w, HAS_RES, UNIT_W, BLOCK_R, BLOCK_W)
            elif (mode == _MODE_LAST) | (mode == _MODE_MEAN):
                n = tl.minimum(tl.maximum(count, 0), tl.minimum(T, cap))
                if pid_r * BLOCK_R < n:
                    if mode == _MODE_LAST:
                        accumulate_segments_tile(
                            x_ptr, res_ptr, ids_ptr, plan_ptr, acc_ptr, acc_labels_ptr, acc_count_ptr,
                            plan0, plan1, plan2, plan3, spec_ok, spec_x, spec_tok,
                            n, T, acc_slots, W, n_ids,
                            stride_xt, stride_xw, stride_rt, stride_rw, stride_ids,
                            pid_r, pid_w, False, HAS_RES, UNIT_W, BLOCK_R, BLOCK_W, BLOCK_T, SHORT)
                    else:
                        accumulate_segments_tile(
                            x_ptr, res_ptr, ids_ptr, plan_ptr, acc_ptr, acc_labels_ptr, acc_count_ptr,
                            plan0, plan1, plan2, plan3, spec_ok, spec_x, spec_tok,
                            n, T, acc_slots, W, n_ids,
                            stride_xt, stride_xw, stride_rt, stride_rw, stride_ids,
                            pid_r, pid_w, True, HAS_RES, UNIT_W, BLOCK_R, BLOCK_W, BLOCK_T, SHORT)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def capture_grid(T: int, W: int, cap: int, entries: int | None = None) -> tuple[int, int]:
    """Launch grid: a function of the padded token count and fixed capacities only (never 0, so
    the execution counter is bumped even for ``T == 0``), or, for an eager launch, of the plan
    entries the host uploaded for the step (``entries``): a program past them would only read
    the plan and exit, and an eager prefill of 16,384 tokens would launch 1,024 rows of programs
    for its few hundred requests' last rows."""
    rows = min(T, cap) if entries is None else min(T, cap, max(entries, 0))
    return (max(1, _cdiv(rows, BLOCK_R)), max(1, _cdiv(W, BLOCK_W)))


def _check(x, residual, input_ids, plan_meta, plan, site, ring, ring_labels, acc, acc_labels, acc_count):
    """Cheap metadata checks (no device reads). Raise ValueError on a layout violation.

    Each message is formatted only when its check fails: this runs at every eager launch (16 a
    forward for a 1B's hidden states), where formatting them all took 38 us a call on the CPU VM."""
    def bad(msg: str) -> ValueError:
        return ValueError(f"launch_capture: {msg}")

    if x.dim() != 2:
        raise bad(f"x must be 2-D [T, W], got {tuple(x.shape)}")
    if x.dtype not in L.STORAGE_DTYPES:
        raise bad(f"x dtype {x.dtype} not in {L.STORAGE_DTYPES}")
    W = x.shape[1]
    if residual is not None:
        if residual.shape != x.shape:
            raise bad(f"residual {tuple(residual.shape)} != x {tuple(x.shape)}")
        if residual.dtype not in L.STORAGE_DTYPES:
            raise bad(f"residual dtype {residual.dtype}")
        if residual.device != x.device:
            raise bad("residual on another device")
    if input_ids is not None:
        if input_ids.dim() != 1:
            raise bad("input_ids must be 1-D")
        if input_ids.dtype not in (torch.int32, torch.int64):
            raise bad(f"input_ids dtype {input_ids.dtype}")
        if input_ids.device != x.device:
            raise bad("input_ids on another device")
    for name, t, shape in (("plan_meta", plan_meta, (L.META_FIELDS,)), ("site", site, (L.SITE_FIELDS,))):
        if tuple(t.shape) != shape:
            raise bad(f"{name} shape {tuple(t.shape)} != {shape}")
    if plan.dim() != 2 or plan.shape[0] != L.PLAN_FIELDS:
        raise bad(f"plan shape {tuple(plan.shape)}")
    cap = plan.shape[1]
    if ring.dim() != 2:
        raise bad(f"ring must be [ring_rows, W], got {tuple(ring.shape)}")
    if ring.dtype not in L.STORAGE_DTYPES:
        raise bad(f"ring dtype {ring.dtype} not in {L.STORAGE_DTYPES}")
    ring_rows = ring.shape[0]
    if ring_rows != 0 and ring.shape[1] != W:
        raise bad(f"ring width {ring.shape[1]} != W {W}")
    if tuple(ring_labels.shape) != (ring_rows, L.LABEL_FIELDS):
        raise bad(f"ring_labels shape {tuple(ring_labels.shape)} != {(ring_rows, L.LABEL_FIELDS)}")
    if acc.dim() != 2 or acc.dtype != torch.float32:
        raise bad("acc must be fp32 [acc_slots, W]")
    n_acc = acc.shape[0]
    if n_acc != 0 and acc.shape[1] != W:
        raise bad(f"acc width {acc.shape[1]} != W {W}")
    if tuple(acc_labels.shape) != (n_acc, L.LABEL_FIELDS):
        raise bad(f"acc_labels shape {tuple(acc_labels.shape)}")
    if tuple(acc_count.shape) != (n_acc,):
        raise bad(f"acc_count shape {tuple(acc_count.shape)}")
    for name, t in (("plan_meta", plan_meta), ("plan", plan), ("site", site), ("ring_labels", ring_labels),
                    ("acc_labels", acc_labels), ("acc_count", acc_count)):
        if t.dtype != torch.int32:
            raise bad(f"{name} must be int32, got {t.dtype}")
    for name, t in (("plan_meta", plan_meta), ("site", site), ("ring", ring),
                    ("ring_labels", ring_labels), ("acc", acc), ("acc_labels", acc_labels),
                    ("acc_count", acc_count)):
        if not t.is_contiguous():
            raise bad(f"{name} must be contiguous (it is a static buffer)")
        if t.device != x.device:
            raise bad(f"{name} on {t.device}, x on {x.device}")
    if cap > 1 and plan.stride() != (1, L.PLAN_FIELDS):
        raise bad(f"plan must be entry-major, strides (1, {L.PLAN_FIELDS}) "
                  f"(layout.new_plan_buffers), got {plan.stride()}")
    if plan.device != x.device:
        raise bad(f"plan on {plan.device}, x on {x.device}")


def capture_reference(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    input_ids: torch.Tensor | None,
    plan_meta: torch.Tensor,
    plan: torch.Tensor,
    site: torch.Tensor,
    ring: torch.Tensor,
    ring_labels: torch.Tensor,
    acc: torch.Tensor,
    acc_labels: torch.Tensor,
    acc_count: torch.Tensor,
    *,
    allow_sync: bool | None = None,
) -> None:
    """The whole per-site step in plain torch (the kernel's semantics; used off CUDA).

    Bumps ``site[SITE_EXECUTIONS]`` with an in-place device add, then applies the mode. With
    ``allow_sync=False`` (default off CPU) it never reads device values on the host, so it is also
    capturable; with ``allow_sync=True`` (default on CPU) it exits early when idle.
    """
    if allow_sync is None:
        allow_sync = x.device.type == "cpu"
    site[L.SITE_EXECUTIONS:L.SITE_EXECUTIONS + 1].add_(1)
    enabled = site[L.SITE_ENABLED] != 0
    if allow_sync:
        if not bool(enabled) or int(plan_meta[L.META_MODE]) == L.MODE_OFF:
            return
        enabled = True
    gather_rows_reference(x, residual, input_ids, plan_meta, plan, ring, ring_labels,
                          enabled=enabled, allow_sync=allow_sync)
    accumulate_reference(x, residual, input_ids, plan_meta, plan, acc, acc_labels, acc_count,
                         enabled=enabled, allow_sync=allow_sync)


def launch_capture(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    input_ids: torch.Tensor | None,
    plan_meta: torch.Tensor,
    plan: torch.Tensor,
    site: torch.Tensor,
    ring: torch.Tensor,
    ring_labels: torch.Tensor,
    acc: torch.Tensor,
    acc_labels: torch.Tensor,
    acc_count: torch.Tensor,
    *,
    use_triton: bool | None = None,
    entries: int | None = None,
) -> None:
    """Capture one site for one step: exactly one kernel launch (or the torch reference).

    ``use_triton=None`` picks the Triton kernel for CUDA tensors when Triton is installed, the torch
    reference otherwise; ``True`` forces the kernel (CPU tensors need ``TRITON_INTERPRET=1`` set
    before this package is imported); ``False`` forces the reference. ``residual`` and
    ``input_ids`` may be ``None`` (token labels are then ``NO_TOKEN``). A site that serves only
    row streams may pass ``acc`` buffers with 0 slots, and vice versa a ring with 0 rows.
    ``entries``: at an eager launch, the count of the plan in ``plan_meta`` (what the host wrote
    there); the grid then covers that many entries only. Never while a CUDA graph is captured,
    whose replays read other steps' plans.
    """
    _check(x, residual, input_ids, plan_meta, plan, site, ring, ring_labels, acc, acc_labels,
           acc_count)
    if entries is not None and x.is_cuda and torch.cuda.is_current_stream_capturing():
        raise ValueError("launch_capture: entries sizes an eager launch's grid; a captured graph "
                         "replays other steps' plans")
    if use_triton is None:
        use_triton = HAVE_TRITON and x.is_cuda
    if not use_triton:
        capture_reference(x, residual, input_ids, plan_meta, plan, site, ring, ring_labels,
                          acc, acc_labels, acc_count)
        return
    if not HAVE_TRITON:
        raise RuntimeError("launch_capture(use_triton=True) needs Triton")
    launch_kernel(*kernel_arguments(x, residual, input_ids, plan_meta, plan, site, ring, ring_labels,
                                    acc, acc_labels, acc_count, entries))


def kernel_arguments(x, residual, input_ids, plan_meta, plan, site, ring, ring_labels, acc,
                     acc_labels, acc_count, entries: int | None = None
                     ) -> tuple[tuple[int, int], tuple, dict]:
    """``capture_site_kernel``'s grid, run-time arguments and compile-time ones for
    :func:`launch_capture`'s arguments (checked)."""
    T, W = x.shape
    cap, ring_rows, n_acc = plan.shape[1], ring.shape[0], acc.shape[0]
    has_res = residual is not None
    res = residual if has_res else x
    stride_rt, stride_rw = (residual.stride(0), residual.stride(1)) if has_res else (0, 0)
    # Column stride 1 (or a single column) in both tensors: compile-time contiguity (coalescing).
    unit_w = W <= 1 or (x.stride(1) == 1 and (not has_res or residual.stride(1) == 1))
    if input_ids is None or input_ids.shape[0] == 0:
        ids, n_ids, stride_ids = plan_meta, 0, 0      # any int32 pointer; never dereferenced
    else:
        ids, n_ids, stride_ids = input_ids, input_ids.shape[0], input_ids.stride(0)
    args = (x, res, ids, plan_meta, plan, site, ring, ring_labels, acc, acc_labels, acc_count,
            T, W, cap, ring_rows, n_acc, n_ids, SPEC_ROWS,
            x.stride(0), x.stride(1), stride_rt, stride_rw, stride_ids)
    constexprs = dict(HAS_RES=has_res, UNIT_W=unit_w, **kernel_tile())
    return capture_grid(T, W, cap, entries), args, constexprs


#: The kernel's compile-time parameters, in its signature's order (after the 23 run-time ones).
CONSTEXPR_PARAMS = ("HAS_RES", "UNIT_W", "BLOCK_R", "BLOCK_W", "BLOCK_T", "SHORT")
#: Argument positions of the tensors whose 16-byte alignment Triton specializes on (every
#: pointer but ``x_ptr``, ``res_ptr`` and ``ids_ptr``), and of the sizes and strides.
_ALIGNED_ARGS = range(3, 11)
_INT_ARGS = range(11, 23)
_INT32 = range(-2**31, 2**31)

#: Compiled capture kernels by :func:`bound_key`, launched without Triton's JIT dispatch.
_bound_kernels: dict[tuple, object] = {}


def bound_key(args: tuple, constexprs: dict, device: int) -> tuple | None:
    """What Triton's JIT specializes the capture kernel on, for these arguments on ``device``:
    the tensors' dtypes, the 16-byte alignment of the pointers it is not told to ignore, and the
    compile-time values. None where a size or stride does not fit int32 (the JIT then types it
    int64): such launches always go through the JIT."""
    if not all(args[i] in _INT32 for i in _INT_ARGS):
        return None
    return (device, args[0].dtype, args[1].dtype, args[2].dtype, args[6].dtype,
            tuple(args[i].data_ptr() % 16 == 0 for i in _ALIGNED_ARGS),
            tuple(constexprs.items()))


def hook_is_empty(hook) -> bool:
    """Whether a Triton launch-hook knob holds no hook: None, or a ``HookChain`` without calls
    (Inductor's launchers read the knobs the same way)."""
    return hook is None or (isinstance(hook, triton.knobs.HookChain) and not hook.calls)


def launch_kernel(grid: tuple[int, int], args: tuple, constexprs: dict) -> None:
    """Launch ``capture_site_kernel``, dispatching through Triton's JIT once per specialization.

    The JIT binds, specializes and hashes every argument at every call; for this kernel's 29
    parameters that was most of an eager launch's host time (session 35, under cProfile: 0.19 ms
    of a 0.31 ms launch, against 0.07 ms for vLLM's own smaller kernels). So a specialization's
    first launch goes through the JIT (compiling or loading), which returns the compiled kernel,
    and later launches call that kernel's launcher directly with what the JIT would pass it, no
    launch metadata and no hooks, as Inductor's own launchers do. With a launch hook installed (a
    profiler's), or off CUDA (the interpreter), every launch takes the JIT.
    """
    rt = triton.knobs.runtime
    key = device = None
    if args[0].is_cuda and hook_is_empty(rt.launch_enter_hook) and hook_is_empty(rt.launch_exit_hook):
        device = triton.runtime.driver.active.get_current_device()
        key = bound_key(args, constexprs, device)
    kernel = _bound_kernels.get(key) if key is not None else None
    if kernel is None:
        kernel = capture_site_kernel[grid](*args, **constexprs)
        if key is not None and kernel is not None:
            _bound_kernels[key] = kernel
        return
    stream = triton.runtime.driver.active.get_current_stream(device)
    kernel.run(grid[0], grid[1], 1, stream, kernel.function, kernel.packed_metadata, None, None, None,
               *args, *(constexprs[name] for name in CONSTEXPR_PARAMS))


def kernel_tile() -> dict:
    """The kernel's compile-time tile (read at each call: benchmarks set the module's values)."""
    return dict(BLOCK_R=BLOCK_R, BLOCK_W=BLOCK_W, BLOCK_T=BLOCK_T, SHORT=MEAN_SHORT,
                num_warps=NUM_WARPS)


def compile_variants(
    dtypes: Iterable[torch.dtype],
    *,
    ids_dtypes: Iterable[torch.dtype] = (torch.int32, torch.int64),
    residual: Iterable[bool] = (False, True),
    tile: dict | None = None,
) -> int:
    """Compile, without launching, the variants :func:`warmup` launches with unit column stride
    (activations of the ring's dtype) for Triton's current device; returns how many.

    Only dtypes are passed (Triton's ``JITFunction.warmup``): no device memory, no stream work.
    So this runs where no CUDA context is (``compile_process``, for the target Triton's active
    driver names), and :func:`warmup` afterwards finds every variant in Triton's cache and only
    loads it. ``tile``: the kernel's tile, default :func:`kernel_tile`. A no-op (returns 0)
    without Triton.
    """
    if not HAVE_TRITON:
        return 0
    tile = tile or kernel_tile()
    i32, f32 = torch.int32, torch.float32
    compiled = 0
    for dtype in dict.fromkeys(dtypes):
        for ids_dtype in dict.fromkeys(ids_dtypes):
            for has_res in residual:
                # The buffers launch_capture passes, by dtype (x, residual, ids, meta, plan,
                # site, ring, ring labels, acc, acc labels, acc count), then its size and stride
                # arguments, none of which is specialised on its value.
                capture_site_kernel.warmup(
                    dtype, dtype, ids_dtype, i32, i32, i32, dtype, i32, f32, i32, i32,
                    *[1] * len(_SIZE_ARGS),
                    HAS_RES=has_res, UNIT_W=True, **tile, grid=(1, 1))
                compiled += 1
    return compiled


def warmup(
    device: torch.device | str,
    dtypes: Iterable[torch.dtype],
    *,
    x_dtypes: Iterable[torch.dtype] | None = None,
    ids_dtypes: Iterable[torch.dtype] = (torch.int32, torch.int64),
    residual: Iterable[bool] = (False, True),
    strided_columns: bool = False,
) -> int:
    """JIT-compile the capture kernel before CUDA-graph capture; returns the number of launches.

    One launch per (ring storage dtype in ``dtypes``) x (activation dtype in ``x_dtypes``, default:
    the same set; the residual is assumed to have the activation's dtype) x (input-id dtype) x
    (with/without residual), on tiny dummy buffers with the mode set to ROWS, with unit column
    stride (``x.stride(1) == 1``, what Inductor hands over in practice); ``strided_columns=True``
    also compiles the generic-column-stride variants. These are all of the kernel's compile-time
    variants: sizes, strides and the ``x``/``residual``/``input_ids`` pointers are not
    specialised, and every site's static buffers start 16-byte aligned
    (``CaptureGraphState.allocate``), so steps with any ``T`` reuse them. The site buffer is a
    dummy, so no real replay counter moves. A no-op (returns 0) off CUDA or without Triton.
    """
    device = torch.device(device)
    if not HAVE_TRITON or device.type != "cuda":
        return 0
    dtypes = list(dict.fromkeys(dtypes))
    x_dtypes = dtypes if x_dtypes is None else list(dict.fromkeys(x_dtypes))
    launches = 0
    W, cap = 3, 2
    plan_meta, plan = L.new_plan_buffers(cap, device)
    plan_meta[L.META_MODE] = L.MODE_ROWS
    plan_meta[L.META_COUNT] = 1
    site = L.new_site_buffer(device)
    acc, acc_labels, acc_count = L.new_acc_buffers(1, W, device)
    for ring_dtype in dtypes:
        ring, ring_labels = L.new_ring_buffers(cap, W, ring_dtype, device)
        for x_dtype in x_dtypes:
            xs = [torch.zeros(2, W, dtype=x_dtype, device=device)]
            if strided_columns:
                xs.append(torch.zeros(W, 2, dtype=x_dtype, device=device).t())
            for x in xs:
                for ids_dtype in ids_dtypes:
                    ids = torch.zeros(2, dtype=ids_dtype, device=device)
                    for with_res in residual:
                        launch_capture(x, x if with_res else None, ids, plan_meta, plan, site, ring,
                                       ring_labels, acc, acc_labels, acc_count, use_triton=True)
                        launches += 1
    torch.cuda.synchronize(device)
    return launches
