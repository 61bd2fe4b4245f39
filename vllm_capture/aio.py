"""The capture calls on vLLM's ``AsyncLLM``, awaited.

    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm_capture import aio

    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model, **vc.engine_kwargs()))
    await aio.start_capture(engine, vc.HIDDEN_STATES, reduce="last")
    ...  # engine.generate(...) for each request
    tensors, meta, layouts = await aio.fetch_captured(engine, vc.HIDDEN_STATES)

Each is ``vllm_capture``'s call of the same name, with the same arguments and results, run through
``await engine.collective_rpc(...)``: the engine goes on serving its other requests meanwhile.
"""

from __future__ import annotations

from vllm_capture.api import (
    Call,
    clear_call,
    fetch_call,
    raise_rpc_error,
    start_call,
    status_call,
    stop_call,
)
from vllm_capture.session.components import HIDDEN_STATES


async def _await(engine, call: Call):
    try:
        replies = await engine.collective_rpc(call.method, args=call.args)
    except Exception as exc:
        raise_rpc_error(call.method, exc)
    return call.result(replies)


async def start_capture(engine, stream: str = HIDDEN_STATES, **config) -> dict:
    return await _await(engine, start_call(stream, config))


async def stop_capture(engine, stream: str = HIDDEN_STATES) -> None:
    await _await(engine, stop_call(stream))


async def clear_captured(engine, stream: str = HIDDEN_STATES) -> None:
    await _await(engine, clear_call(stream))


async def capture_status(engine, stream: str = HIDDEN_STATES, all_ranks: bool = False):
    return await _await(engine, status_call(stream, all_ranks))


async def fetch_captured(engine, stream: str = HIDDEN_STATES, clear: bool = True,
                         layers: list[int] | None = None, req_ids: list[str] | None = None):
    return await _await(engine, fetch_call(stream, clear, layers, req_ids))
