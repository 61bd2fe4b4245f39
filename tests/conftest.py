"""Shared fixtures. Engine tests (``@pytest.mark.engine``) start one real vLLM engine per module."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# vLLM's CPU backend reserves this many GiB of KV cache per engine; its default (all free memory
# minus a margin) is far more than the tiny models need and slows start-up.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    """Where tiny checkpoints are built: $VLLM_CAPTURE_TINY_DIR, else a session temp dir."""
    folder = os.environ.get("VLLM_CAPTURE_TINY_DIR")
    if folder:
        path = Path(folder)
        path.mkdir(parents=True, exist_ok=True)
        return path
    return tmp_path_factory.mktemp("tiny")


@pytest.fixture(scope="session")
def tiny_model(tiny_dir):
    """``tiny_model(name)`` builds (or reuses) a tiny checkpoint and returns its folder."""
    from vllm_capture.tiny_models import build

    def get(name: str) -> Path:
        return build(name, tiny_dir / name)

    return get
