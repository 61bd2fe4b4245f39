"""Hidden-state capture kernels forked off a FULL CUDA graph's critical path (experimental).

Why: in a replayed decode graph a capture kernel costs about 2.15 us at the 1B's width, of which
about 1.5 us is what any kernel costs between two others (session 37's ``capture_nodes.py``).
Launched on a second stream, the kernel becomes a branch of the graph that runs beside the next
layer, and the graph's stream waits for it only before that layer ends.

How: while a FULL graph is captured, the op at layer i's hidden-state site forks: the side stream
waits for the graph's stream, the kernel is launched on the side stream, and the buffers it reads
are noted. Layer i+1's forward then calls ``vllm_capture::join`` with its inputs, which are layer
i's outputs, and with its own output; the graph's stream waits for the side stream there. The join
op takes those tensors as arguments, so Inductor keeps their buffers alive (unwritten) until the
join, and orders the join after layer i+1's work. A join whose tensors are not the forked
kernel's buffers raises: the model passes something else between its layers, and the fork would
race with whatever reuses those buffers.

Only FULL captures fork: a piecewise graph ends at each attention, and a stream forked inside it
must rejoin before its capture ends. Eager steps and piecewise captures launch on the current
stream as before. The last layer's site never forks (no layer after it joins).
"""

from __future__ import annotations

from typing import Callable

import torch

JoinKey = tuple[int, int | None]


def _buffers(x: torch.Tensor, residual: torch.Tensor | None) -> JoinKey:
    return x.data_ptr(), None if residual is None else residual.data_ptr()


def in_full_graph_capture() -> bool:
    """Whether vLLM is capturing a FULL CUDA graph now (its forward context says so)."""
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import get_forward_context, is_forward_context_available

    return (is_forward_context_available()
            and get_forward_context().cudagraph_runtime_mode == CUDAGraphMode.FULL)


class CudaStreams:
    """The stream operations a fork needs, on ``device``'s current stream and one side stream."""

    def __init__(self, device: torch.device):
        self.device = device
        self.side = torch.cuda.Stream(device=device)

    def fork(self) -> None:
        self.side.wait_stream(torch.cuda.current_stream(self.device))

    def on_side(self):
        return torch.cuda.stream(self.side)

    def join(self) -> None:
        torch.cuda.current_stream(self.device).wait_stream(self.side)


class ForkedLaunches:
    """Launches forked at sites (keyed by the site's counter address) and not yet joined."""

    def __init__(self, streams, in_full_capture: Callable[[], bool] = in_full_graph_capture):
        self._streams = streams
        self._in_full_capture = in_full_capture
        self._pending: dict[int, JoinKey] = {}

    def launch(self, key: int, x: torch.Tensor, residual: torch.Tensor | None,
               launch: Callable[[], None]) -> bool:
        """Run ``launch`` on the side stream if a FULL graph is being captured (True); else do
        nothing (False: the caller launches on its own stream)."""
        if not self._in_full_capture():
            return False
        self._streams.fork()
        with self._streams.on_side():
            launch()
        self._pending[key] = _buffers(x, residual)
        return True

    def join(self, key: int, x: torch.Tensor, residual: torch.Tensor | None) -> None:
        """The current stream waits for the launch forked at ``key``, whose buffers must be
        ``x`` and ``residual`` (the next layer's inputs); nothing was forked: nothing to do."""
        forked = self._pending.pop(key, None)
        if forked is None:
            return
        if forked != _buffers(x, residual):
            self._streams.join()  # the capture must still end joined
            raise RuntimeError(
                "vllm-capture: fork_hidden_states: the next layer's inputs are not the tensors "
                "captured at the layer before it (the model changes them between its layers); "
                "build the engine without fork_hidden_states")
        self._streams.join()

    @property
    def pending(self) -> int:
        return len(self._pending)

    def reset(self) -> None:
        """Forget forks of a forward that did not finish (before the next capture run)."""
        self._pending.clear()
