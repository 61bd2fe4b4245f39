"""Per-step wrappers: hand each runner's batch to the session as StepBuffers; bracket the forward.

The only vLLM-version-specific knowledge of the step lives here. Both wrappers run on the worker
thread, in step order. The plans and gathers they enqueue go to the current stream; a drain's
device-to-host copies go to the graph state's copy stream after an event on it, and a later step
that writes ring rows a copy still reads waits for that copy first, even under async scheduling.

- V1 runner (and the CPU runner, its subclass): ``execute_model`` sees the scheduler output;
  ``_model_forward`` is called once per real step after the inputs are prepared (dummy, profile
  and capture runs call the model directly and so never plan rows).
- V2 runner: ``execute_model`` (skipping ``dummy_run``) and ``prepare_inputs``, which returns the
  step's ``InputBatch``.
- Both: ``_dummy_run`` and ``capture_model`` switch the device plans off first (a step leaves its
  plan there, so that the next step repeating it uploads nothing); ``capture_model`` first waits
  for the capture kernels to be compiled.
"""

from __future__ import annotations

from vllm_capture.selection import StepBuffers

# Synthetic requests that vLLM pushes through real steps while it warms up.
_WARMUP_PREFIXES = ("_warmup_", "_v2_mixed_warmup", "_dummy_req_")


def observe_scheduler_output(session, scheduler_output) -> None:
    finished = getattr(scheduler_output, "finished_req_ids", None) or ()
    if finished:
        session.finish_requests(finished)
    for new in getattr(scheduler_output, "scheduled_new_reqs", None) or ():
        if new.req_id.startswith(_WARMUP_PREFIXES):
            continue
        session.add_request(new.req_id, new.prompt_token_ids, new.sampling_params)


# Runner methods that run forwards which are not steps (dummy, profile and capture runs). A step
# leaves its plan on the device, so these switch it off first.
_UNPLANNED_FORWARDS = ("_dummy_run", "capture_model")


def _switch_off_before_unplanned_forwards(runner, session) -> None:
    for name in _UNPLANNED_FORWARDS:
        method = getattr(runner, name, None)
        if method is None:
            continue

        def unplanned(*args, _method=method, _capture=name == "capture_model", **kwargs):
            session.switch_off()
            if _capture:
                # Graph capture records the kernels' first launches: they must be compiled and
                # loaded by then (they compile in a child process while vLLM compiles the model).
                session.await_kernels()
            return _method(*args, **kwargs)

        setattr(runner, name, unplanned)


def wrap_v1_runner(runner, session):
    """V1 GPU runner and the CPU runner."""
    execute_model = runner.execute_model
    model_forward = runner._model_forward

    def capture_execute_model(scheduler_output, *args, **kwargs):
        observe_scheduler_output(session, scheduler_output)
        return execute_model(scheduler_output, *args, **kwargs)

    def capture_model_forward(*args, **kwargs):
        if not session.any_stream_enabled():
            return model_forward(*args, **kwargs)
        batch = runner.input_batch
        n = batch.num_reqs
        tokens = kwargs.get("input_ids")
        if tokens is None:
            tokens = kwargs.get("inputs_embeds")
        session.begin_step(StepBuffers(batch.req_ids[:n], runner.query_start_loc.np,
                                       batch.num_computed_tokens_cpu, tokens.shape[0]))
        try:
            return model_forward(*args, **kwargs)
        finally:
            session.end_step()

    runner.execute_model = capture_execute_model
    runner._model_forward = capture_model_forward
    _switch_off_before_unplanned_forwards(runner, session)
    return runner.input_ids.gpu


def wrap_v2_runner(runner, session):
    execute_model = runner.execute_model
    prepare_inputs = runner.prepare_inputs

    def capture_execute_model(scheduler_output, *args, dummy_run: bool = False, **kwargs):
        if dummy_run:
            session.switch_off()
            return execute_model(scheduler_output, *args, dummy_run=True, **kwargs)
        observe_scheduler_output(session, scheduler_output)
        try:
            return execute_model(scheduler_output, *args, **kwargs)
        finally:
            if session.step_open:
                session.end_step()

    def capture_prepare_inputs(scheduler_output, *args, **kwargs):
        batch = prepare_inputs(scheduler_output, *args, **kwargs)
        if session.any_stream_enabled():
            session.begin_step(StepBuffers(batch.req_ids, batch.query_start_loc_np,
                                           batch.num_computed_tokens_np,
                                           batch.num_tokens_after_padding))
        return batch

    runner.execute_model = capture_execute_model
    runner.prepare_inputs = capture_prepare_inputs
    _switch_off_before_unplanned_forwards(runner, session)
    return runner.input_buffers.input_ids


def wrap_runner(runner, session):
    """Install the wrappers that fit ``runner``; return its persistent token-id buffer."""
    if hasattr(runner, "input_buffers") and hasattr(runner, "prepare_inputs"):
        return wrap_v2_runner(runner, session)
    if hasattr(runner, "_model_forward") and hasattr(runner, "input_batch"):
        return wrap_v1_runner(runner, session)
    raise RuntimeError(f"vllm-capture does not know the model runner {type(runner).__name__}")
