"""What one capture kernel adds to a CUDA graph, per launch configuration (no engine).

A graph of ``--layers`` stand-ins for a decoder layer's last kernel (an in-place sign flip of a
[T, W] bf16 activation, with a residual) is captured four ways per configuration:

* ``none``: the stand-ins alone;
* ``exiting``: each followed by the capture kernel of a site whose flag is off;
* ``last``: each followed by the capture kernel reducing every row into an accumulator slot (a
  decode step of a last-token stream, one request per row);
* ``rows``: the same gathering every row into the ring (a decode step of an all-positions stream).

Each graph is replayed ``--replays`` times back to back, timed with CUDA events; the table gives
microseconds per capture kernel over ``none``. Configurations are ``BLOCK_W x NUM_WARPS x
SPEC_ROWS`` of ``vllm_capture.kernels.capture`` (set on the module before the launches, so each
tile compiles its own variant; ``SPEC_ROWS`` 0 turns off reading rows alongside the plan).
Prints one JSON line per configuration. Session 11 also measured a launch with
programmatic dependent launch (the kernel's launch overlapping the end of the stand-in): 0.3 us
saved on a last-token kernel, 0.14-0.16 us lost on the others; not kept
(``benchmarks/results/2026-12-01-h200-session11/README.md``).

``--forked`` measures instead the shipped tile's last-token kernel between stand-in layers that
do other work (a matmul) before the activation is written again, launched on the graph's stream
(as the op does) and forked onto a second stream, joined before the next write: whether the
kernel boundary, most of a last-token kernel's cost, leaves the replay when the kernel runs
beside other work (session 37's README).

    python3 benchmarks/capture_nodes.py [--tokens 64] [--width 4096] [--layers 32] [--forked]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from vllm_capture.kernels import capture as C  # noqa: E402
from vllm_capture.kernels import layout as L  # noqa: E402

# (BLOCK_W, NUM_WARPS, SPEC_ROWS); session 10 compared six tiles without the early row read
CONFIGS = ((64, 8, 0), (64, 8, 256), (128, 8, 0), (128, 8, 256), (128, 4, 256))


def _graph_us(launch, replays: int) -> float:
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        launch()  # compile and warm outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            launch()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / replays)
    return best


class StandIn:
    """A [T, W] bf16 activation with its residual, and ``layers`` capture sites over one plan,
    ring and accumulator: every row is its own request (row ``i`` reduces into slot ``i``)."""

    def __init__(self, tokens: int, width: int, layers: int):
        dev = torch.device("cuda")
        self.tokens = tokens
        self.x = torch.randn(tokens, width, dtype=torch.bfloat16, device=dev)
        self.residual = torch.randn(tokens, width, dtype=torch.bfloat16, device=dev)
        self.ids = torch.zeros(tokens, dtype=torch.int32, device=dev)
        self.meta, self.plan = L.new_plan_buffers(tokens, dev)
        self.ring, self.ring_labels = L.new_ring_buffers(tokens, width, torch.bfloat16, dev)
        self.acc, self.acc_labels, self.acc_count = L.new_acc_buffers(tokens, width, dev)
        self.sites = [L.new_site_buffer(dev) for _ in range(layers)]
        self.rows = torch.arange(tokens, dtype=torch.int32, device=dev)

    def set_mode(self, mode: int, enabled: int) -> None:
        for site in self.sites:
            site[L.SITE_ENABLED] = enabled
        meta, plan, rows = self.meta, self.plan, self.rows
        meta.zero_()
        meta[L.META_MODE], meta[L.META_COUNT] = mode, self.tokens
        if mode == L.MODE_ROWS:
            plan[L.PLAN_ROW], plan[L.PLAN_REQ], plan[L.PLAN_POS] = rows, 0, rows
        else:
            plan[L.PLAN_SEG_START], plan[L.PLAN_SEG_COUNT] = rows, 1
            plan[L.PLAN_SEG_SLOT], plan[L.PLAN_SEG_REQ] = rows, 0

    def capture(self, site: torch.Tensor) -> None:
        C.launch_capture(self.x, self.residual, self.ids, self.meta, self.plan, site, self.ring,
                         self.ring_labels, self.acc, self.acc_labels, self.acc_count)

    def want(self) -> torch.Tensor:
        """A row as a capture reads it: the activation plus its residual, in fp32."""
        return self.x.float() + self.residual.float()


def measure(tokens: int, width: int, layers: int, replays: int, block_w: int, warps: int,
            spec_rows: int) -> dict:
    C.BLOCK_W, C.NUM_WARPS, C.SPEC_ROWS = block_w, warps, spec_rows
    bench = StandIn(tokens, width, layers)
    x = bench.x

    def layers_only():
        for _ in range(layers):
            x.neg_()

    def with_capture():
        for site in bench.sites:
            x.neg_()
            bench.capture(site)

    base = _graph_us(layers_only, replays)
    out = {"block_w": block_w, "num_warps": warps, "spec_rows": spec_rows, "tokens": tokens,
           "grid": C.capture_grid(tokens, width, tokens),
           "none_us": round(base, 2)}
    for name, mode, enabled in (("exiting", L.MODE_OFF, 0), ("last", L.MODE_LAST, 1),
                                ("rows", L.MODE_ROWS, 1)):
        bench.set_mode(mode, enabled)
        out[f"{name}_us_per_kernel"] = round((_graph_us(with_capture, replays) - base) / layers, 3)
    # The last site read the activation as its stand-in left it (a read that overtook the stand-in
    # would see the other sign; `layers` is even).
    want = bench.want()
    out["rows_right"] = bool(torch.equal(bench.ring, want.to(bench.ring.dtype)))
    bench.set_mode(L.MODE_LAST, 1)
    _graph_us(with_capture, 1)
    out["last_right"] = bool(torch.equal(bench.acc, want))
    return out


def measure_forked(tokens: int, width: int, layers: int, replays: int) -> dict:
    """The shipped tile's ``last`` kernel on the graph's critical path, and forked off it.

    Each stand-in layer writes the activation (``x.neg_()``), then runs work that leaves ``x``
    and ``residual`` alone (a [T, W] x [W, W] matmul, standing in for the next layer's attention),
    before the next layer writes ``x`` again. ``serial`` launches the capture kernel on the
    graph's stream right after the write, as the op does today; ``forked`` launches it on a
    second stream that waits for the write, and the graph's stream waits for it before the next
    write: in the graph, a branch beside the matmul. The difference per kernel over ``none`` is
    what each costs the replay.
    """
    bench = StandIn(tokens, width, layers)
    bench.set_mode(L.MODE_LAST, 1)
    x, sites, dev = bench.x, bench.sites, bench.x.device
    weight = torch.randn(width, width, dtype=torch.bfloat16, device=dev) / width ** 0.5
    other = torch.empty(tokens, width, dtype=torch.bfloat16, device=dev)
    side = torch.cuda.Stream(dev)

    def none():
        for _ in sites:
            x.neg_()
            torch.mm(x, weight, out=other)

    def serial():
        for site in sites:
            x.neg_()
            bench.capture(site)
            torch.mm(x, weight, out=other)

    def forked():
        main = torch.cuda.current_stream(dev)
        for site in sites:
            x.neg_()
            side.wait_stream(main)
            with torch.cuda.stream(side):
                bench.capture(site)
            torch.mm(x, weight, out=other)
            main.wait_stream(side)

    base = _graph_us(none, replays)
    out = {"mode": "forked", "block_w": C.BLOCK_W, "num_warps": C.NUM_WARPS,
           "spec_rows": C.SPEC_ROWS, "tokens": tokens, "width": width, "layers": layers,
           "none_us": round(base, 2)}
    # Every run leaves x as it found it (`layers` is even), and the last site reduces x as its
    # layer wrote it: a read that overtook that write, or came after the next, has the other sign.
    want = bench.want()
    for name, launch in (("serial", serial), ("forked", forked)):
        out[f"{name}_us_per_kernel"] = round((_graph_us(launch, replays) - base) / layers, 3)
        bench.acc.zero_()
        _graph_us(launch, 1)
        out[f"{name}_right"] = bool(torch.equal(bench.acc, want))
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--layers", type=int, default=32, help="an even number")
    p.add_argument("--replays", type=int, default=500)
    p.add_argument("--forked", action="store_true",
                   help="only the shipped tile's last-token kernel, on the critical path and "
                        "forked onto a second stream beside other work (measure_forked)")
    args = p.parse_args()
    if args.layers % 2:
        p.error("--layers must be even")
    if args.forked:
        print(json.dumps(measure_forked(args.tokens, args.width, args.layers, args.replays)),
              flush=True)
        return 0
    for block_w, warps, spec_rows in CONFIGS:
        try:
            out = measure(args.tokens, args.width, args.layers, args.replays, block_w, warps,
                          spec_rows)
        except Exception as exc:  # one configuration the driver refuses does not end the table
            out = {"block_w": block_w, "num_warps": warps, "spec_rows": spec_rows,
                   "error": repr(exc)[:300]}
        print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
