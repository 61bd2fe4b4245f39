"""The environment the engine tests run in: the pinned vLLM and the registered plugin.

These fail loudly (no skips): a missing or wrong vLLM, or a plugin that vLLM cannot find, would
otherwise make every engine test fail with an unrelated-looking error or silently capture nothing.
"""

from importlib.metadata import entry_points


def test_vllm_version():
    import vllm

    assert vllm.__version__ == "0.26.0", f"vllm {vllm.__version__} installed, need 0.26.0"


def test_plugin_entry_point_registered():
    plugins = entry_points(group="vllm.general_plugins")
    ours = [ep for ep in plugins if ep.name == "vllm_capture"]
    assert len(ours) == 1, f"vllm.general_plugins entry points: {[ep.name for ep in plugins]}"
    assert ours[0].value == "vllm_capture.engine.plugin:register"
    register = ours[0].load()
    assert callable(register)


def test_plugin_registers_capture_op():
    import torch

    from vllm_capture.engine.plugin import register

    register()
    register()  # idempotent: vLLM loads general plugins in every process, possibly twice
    assert hasattr(torch.ops.vllm_capture, "capture")
