"""The ``vllm.general_plugins`` entry point: loaded in every vLLM process.

It only registers the capture op, so that a compiled artifact that references it loads in any
process. Everything else happens in worker processes, and only for engines whose config asks for
capture (see ``worker_ext``): a plugin is global to the environment and must stay inert otherwise.
"""


def register() -> None:
    from vllm_capture.kernels.ops import register_op

    register_op()
