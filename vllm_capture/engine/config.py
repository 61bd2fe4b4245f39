"""The engine-side capture configuration, carried in ``additional_config["capture"]``.

``additional_config`` enters vLLM's compile-cache hash, so an engine built with capture never
loads a compiled artifact that was built without the capture ops (and vice versa). The version
makes artifacts of older vllm-capture releases miss the cache too.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

from vllm_capture.checks import is_int
from vllm_capture.session.components import COMPONENTS

CONFIG_KEY = "capture"
CONFIG_VERSION = 2
WORKER_EXTENSION = "vllm_capture.engine.worker_ext.CaptureWorkerExtension"


@dataclass(frozen=True)
class EngineCaptureConfig:
    """What to instrument at model load, and how much device memory capture may take."""

    components: tuple[str, ...] = COMPONENTS
    # Device bytes for the ring buffers of all sites together; sets rows per step. None: every
    # site holds all rows of the largest step (max_num_batched_tokens), so no row is dropped.
    buffer_bytes: int | None = None
    # Requests that can hold a last/mean accumulator at once. None: max_num_seqs, every request
    # that can run at once (a request preempted while others run keeps its slot: more give room).
    reduce_slots: int | None = None
    ring_slots: int = 2
    version: int = field(default=CONFIG_VERSION)

    def __post_init__(self):
        # tuple("abc") would split a string into letters
        if isinstance(self.components, (str, bytes)) or not isinstance(self.components, Iterable):
            raise ValueError(f"components: expected a list of component names, got "
                             f"{self.components!r}; choose from {list(COMPONENTS)}")
        comps = tuple(self.components)
        bad = [c for c in comps if c not in COMPONENTS]
        if not comps or bad:
            raise ValueError(f"components: unknown {bad or 'empty list'}; choose from {list(COMPONENTS)}")
        if len(set(comps)) != len(comps):
            raise ValueError(f"components: {list(comps)} names a component twice")
        if not isinstance(self.components, (list, tuple)):
            # A set's order changes from process to process, and the config enters vLLM's
            # compile-cache hash.
            comps = tuple(sorted(comps, key=COMPONENTS.index))
        object.__setattr__(self, "components", comps)
        for name in ("buffer_bytes", "reduce_slots", "ring_slots"):
            value = getattr(self, name)
            if name != "ring_slots" and value is None:
                continue
            if not is_int(value) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
            object.__setattr__(self, name, int(value))  # it travels in vLLM's JSON config
        if isinstance(self.version, bool) or self.version != CONFIG_VERSION:
            raise ValueError(f"version: this vllm-capture speaks config version {CONFIG_VERSION}, "
                             f"got {self.version!r}")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["components"] = list(self.components)
        return d

    @classmethod
    def from_vllm_config(cls, vllm_config) -> "EngineCaptureConfig | None":
        extra = getattr(vllm_config, "additional_config", None) or {}
        raw = extra.get(CONFIG_KEY)
        if raw is None:
            return None
        if not isinstance(raw, dict):
            raise ValueError(f"additional_config[{CONFIG_KEY!r}] must be a dict, got {type(raw).__name__}")
        unknown = set(raw) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"additional_config[{CONFIG_KEY!r}]: unknown keys {sorted(unknown)}")
        return cls(**raw)


def engine_kwargs(components=COMPONENTS, buffer_bytes: int | None = None,
                  reduce_slots: int | None = None, **llm_kwargs) -> dict:
    """Keyword arguments for ``vllm.LLM(...)`` (or ``AsyncEngineArgs``) that make it capture-ready."""
    cfg = EngineCaptureConfig(components, buffer_bytes, reduce_slots)
    additional = llm_kwargs.pop("additional_config", None) or {}
    if not isinstance(additional, dict):
        raise ValueError(f"additional_config: expected a dict, got {type(additional).__name__}")
    if CONFIG_KEY in additional:
        # It would be replaced by this call's own: say so rather than drop the caller's options.
        raise ValueError(f"additional_config[{CONFIG_KEY!r}]: set by engine_kwargs itself; pass "
                         f"components, buffer_bytes and reduce_slots as its arguments instead")
    additional = {**additional, CONFIG_KEY: cfg.to_dict()}
    existing = llm_kwargs.pop("worker_extension_cls", None)
    if existing not in (None, "", WORKER_EXTENSION):
        raise ValueError(f"worker_extension_cls: already set to {existing!r}; vllm-capture needs "
                         f"{WORKER_EXTENSION!r}")
    return {**llm_kwargs, "additional_config": additional, "worker_extension_cls": WORKER_EXTENSION}
