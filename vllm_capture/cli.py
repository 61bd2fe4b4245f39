"""``vllm-capture``: extract activation datasets, inspect them, and a one-command demo.

Commands::

    vllm-capture extract MODEL PROMPTS --out DIR [--components hidden_states,attention_heads]
        [--layers all|0,2,5-7|-1] [--select last|all|'{"prompt_window": [-8, null]}']
        [--storage-dtype float32|float16|bfloat16] [--max-tokens N] [--batch-size N]
        [--shard-rows N] [--shard-mb MB] [--no-progress]
        [--tensor-parallel-size N] [--max-model-len N] [--gpu-memory-utilization F]
        [--enforce-eager] [--max-num-batched-tokens N] [--max-num-seqs N] [--dtype D]
        [--load-format F] [--capture-buffer-bytes N]
    vllm-capture inspect DIR [--plot norms.png] [--verify] [--no-stats]
    vllm-capture demo [--out DIR] [--plot norms.png] [--no-progress]

``extract`` reads prompts from a ``.txt`` file (one prompt per non-blank line) or a ``.jsonl`` file
(one object per line: ``prompt``, optional ``id``, optional ``select`` = a SelectSpec wire dict
that replaces ``--select`` for that prompt). It processes the prompts in batches of
``--batch-size``; for every batch one greedy generate captures every requested component
(``capture_streams``), so the components' rows are of the same sequences, each component with
its own label columns. It writes a shard (see
``vllm_capture.dataset`` for the format) whenever the buffered rows reach ``--shard-rows`` or
``--shard-mb``, so memory stays bounded by one shard plus one batch, whatever the corpus size.
A shard holds whole batches; ``rows`` counts token positions per component.

The engine is injectable: ``extract(llm, prompts, out_dir, model=...)`` does the work for an
engine built by ``vllm_capture.LLM``; ``main(argv, llm_factory=...)`` is the command line.

Selections: ``last`` = the last prompt row of each prompt (``SelectSpec(prompt_positions=[-1])``);
``all`` = every prompt row, plus the generated rows when ``--max-tokens`` > 1 (``max_tokens=N``
gives N-1 generated rows: the last sampled token is never fed back); anything else is parsed as a
SelectSpec wire dict in JSON.

Resuming: shards are written under a temporary name and renamed once complete; ``manifest.json``
(replaced atomically after each shard) lists the finished shards and the prompt range each one
covers. Rerunning the same command resumes after the last finished shard; files an interrupted run
left behind (temporary or unlisted shards) are removed first, so rows are never duplicated. A
folder holding a different run (other model or model files, load format, prompts, components,
layers, selection, dtypes or max tokens) is refused. The manifest records each component's
storage dtype; a batch that comes back in another (a resumed run on an engine whose ``auto``
dtype differs) stops the run.

Bad input (missing or empty prompt files, malformed JSONL lines, duplicate prompt ids, unknown
components or layers, invalid selections or ones that cannot select a row at ``--max-tokens``, a
mismatched output folder or one that cannot be created) is reported as one line on stderr with
exit code 2, before the engine starts and before anything is written. Prompts longer than the
engine's ``max_model_len`` are found once the engine has started, still before anything is
written.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence, get_args

from vllm_capture.checks import as_count, is_int
from vllm_capture.dataset import (FORMAT, FORMAT_VERSION, LABEL_COLUMNS, MANIFEST, PROMPT_LENGTH,
                                  PROMPTS_FILE, SHARD_PREFIX, DatasetError, label_name,
                                  load_dataset, prompts_sha256, sha256_file, shard_name,
                                  tensor_name, write_json_atomic, write_text_atomic)
from vllm_capture.dtypes import dtype_name
from vllm_capture.session.components import COMPONENTS, HIDDEN_STATES, ROUTER_LOGITS
from vllm_capture.tiny_models import CORPUS

PROG = "vllm-capture"

# The demo's prompts: the tiny model's training sentences (its word-level vocabulary) and a few
# recombinations of them.
DEMO_PROMPTS = [
    *CORPUS,
    "the lazy dog sees the brown fox",
    "one layer of the model reads the hidden states",
    "every step the router logits choose experts",
    "left right up down the ring buffer",
]

# Engine options of the demo (and of the tests' shared engine): small and CPU friendly.
# Eager mode: torch.compile's first warm-up costs about a minute more on a 2-core CPU.
DEMO_ENGINE = dict(dtype="float32", max_model_len=256, max_num_batched_tokens=256, max_num_seqs=16,
                   seed=0, enforce_eager=True)
DEMO_COMPONENTS = ("hidden_states", "attention_heads")
DEMO_MAX_TOKENS = 4

_ENGINE_OPTIONS = ("tensor_parallel_size", "max_model_len", "gpu_memory_utilization",
                   "enforce_eager", "max_num_batched_tokens", "max_num_seqs", "dtype",
                   "load_format", "capture_buffer_bytes")
_MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


class UsageError(Exception):
    """Bad input: reported as one line on stderr, exit code 2."""


# ---- prompts -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Prompt:
    index: int
    id: str
    text: str
    select: dict | None = None  # canonical SelectSpec wire dict, or None: the run's selection
    line: int = 0


def _check_prompts(records: Sequence[Prompt], where: Callable[[Prompt], str]) -> list[Prompt]:
    """The checks every prompt passes, read from a file or given from Python: text that is not
    empty, a valid ``select`` (made canonical), a unique id. UsageError names the prompt by
    ``where(prompt)``."""
    from vllm_capture.selection import SelectSpec

    prompts: list[Prompt] = []
    first: dict[str, Prompt] = {}
    for record in records:
        at = where(record)
        if not isinstance(record.text, str):
            raise UsageError(f"{at}: \"prompt\" must be a string, got "
                             f"{type(record.text).__name__}")
        if not record.text.strip():
            raise UsageError(f"{at}: \"prompt\" is empty")
        if not isinstance(record.id, str):
            raise UsageError(f"{at}: \"id\" must be a string, got {record.id!r}")
        if record.id in first:
            raise UsageError(f"{at}: duplicate prompt id {record.id!r} (first at "
                             f"{where(first[record.id])})")
        first[record.id] = record
        select = record.select
        if select is not None:
            try:
                spec = select if isinstance(select, SelectSpec) else SelectSpec.from_wire(select)
            except (TypeError, ValueError) as exc:
                raise UsageError(f"{at}: invalid \"select\": {exc}") from None
            select = spec.to_wire()
        prompts.append(Prompt(record.index, record.id, record.text, select, record.line))
    if not prompts:
        raise UsageError("prompts: empty")
    return prompts


def load_prompts(path: str | os.PathLike) -> list[Prompt]:
    """Prompts of a ``.txt`` (one per non-blank line) or ``.jsonl`` file; UsageError if bad."""
    path = Path(path)
    if not path.exists():
        raise UsageError(f"prompts file not found: {path}")
    if not path.is_file():
        raise UsageError(f"prompts: {path} is not a file")
    suffix = path.suffix.lower()
    if suffix not in (".txt", ".jsonl"):
        raise UsageError(f"prompts: {path} must be a .txt (one prompt per line) or .jsonl file")
    try:
        # One prompt per "\n" (str.splitlines would also split on form feeds, U+2028 and more,
        # which a prompt may hold); a byte-order mark is not text.
        lines = [line.removesuffix("\r")
                 for line in path.read_text(encoding="utf-8-sig").split("\n")]
    except UnicodeDecodeError as exc:
        raise UsageError(f"prompts: {path} is not UTF-8 text ({exc.reason})") from None
    records: list[Prompt] = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        index = len(records)
        select = None
        if suffix == ".txt":
            text, pid = line, str(index)
        else:
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UsageError(f"{where}: malformed JSON ({exc.msg}, column {exc.colno})") from None
            if not isinstance(obj, dict):
                raise UsageError(f"{where}: expected a JSON object with a \"prompt\" field, got "
                                 f"{type(obj).__name__}")
            if "prompt" not in obj:
                raise UsageError(f"{where}: missing \"prompt\" field")
            text = obj["prompt"]
            raw_id = obj.get("id", index)
            if isinstance(raw_id, bool) or not isinstance(raw_id, (str, int)):
                raise UsageError(f"{where}: \"id\" must be a string or an int, got "
                                 f"{json.dumps(raw_id)}")
            pid = str(raw_id)
            select = obj.get("select")
        records.append(Prompt(index, pid, text, select, lineno))
    if not records:
        raise UsageError(f"prompts: {path} holds no prompts")
    return _check_prompts(records, lambda p: f"{path}:{p.line}")


def _as_prompts(prompts: Sequence) -> list[Prompt]:
    """Strings or Prompt records (``load_prompts``' or the caller's), checked like a file's."""
    records = []
    for i, p in enumerate(prompts):
        if isinstance(p, Prompt):
            if p.index != i:
                raise ValueError(f"prompts[{i}]: index {p.index}, expected {i}")
            records.append(p)
        elif isinstance(p, str):
            records.append(Prompt(i, str(i), p))
        else:
            raise TypeError(f"prompts[{i}]: expected a str or a Prompt, got {type(p).__name__}")
    return _check_prompts(records, lambda p: f"prompts[{p.index}]")


def describe_prompt(prompt: Prompt) -> str:
    """How errors name a prompt: its id, and its line in the prompts file (or its index)."""
    return f"prompt {prompt.id!r} " + (f"(line {prompt.line})" if prompt.line
                                       else f"(prompts[{prompt.index}])")


# ---- options -------------------------------------------------------------------------------------

def parse_components(values: Sequence[str] | str | None) -> list[str]:
    if values is None:
        return [HIDDEN_STATES]
    if isinstance(values, str):
        values = [values]
    out: list[str] = []
    for value in values:
        for name in str(value).split(","):
            name = name.strip()
            if not name:
                continue
            if name not in COMPONENTS:
                raise UsageError(f"unknown component {name!r}; choose from {', '.join(COMPONENTS)}")
            if name not in out:
                out.append(name)
    if not out:
        raise UsageError(f"--components: name at least one of {', '.join(COMPONENTS)}")
    return out


def parse_layers(value: str | Sequence[int] | None) -> list[int] | None:
    """``all``/None -> None; ``"0,2,5-7,-1"`` -> ints (negative ones count from the end)."""
    if value is None:
        return None
    if not isinstance(value, str):
        items = list(value)
        if not items or not all(map(is_int, items)):
            raise UsageError(f"--layers: expected a list of ints, got {value!r}")
        return sorted(set(map(int, items)))
    text = value.strip().lower()
    if text == "all":
        return None
    out: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        # ASCII digits only: int() would also read "1_0" as 10 and other scripts' digits.
        single, span = _LAYER.fullmatch(part), _LAYER_SPAN.fullmatch(part)
        if single:
            out.add(int(part))
        elif span and int(span[1]) <= int(span[2]):
            out.update(range(int(span[1]), int(span[2]) + 1))
        else:
            raise UsageError(f"--layers: cannot parse {part!r} in {value!r}; use 'all' or a list "
                             "like 0,2,5-7 (negative numbers count from the last layer)")
    return sorted(out)


_LAYER = re.compile(r"-?[0-9]+")
_LAYER_SPAN = re.compile(r"([0-9]+)-([0-9]+)")


def resolve_layers(requested: list[int] | None, available: Sequence[int], where: str) -> list[int]:
    available = sorted(int(x) for x in available)
    if requested is None:
        return available
    count = (available[-1] + 1) if available else 0
    out = set()
    bad = []
    for layer in requested:
        resolved = layer + count if layer < 0 else layer
        if resolved not in available:
            bad.append(layer)
        else:
            out.add(resolved)
    if bad:
        shown = (f"{available[0]}..{available[-1]}" if available == list(range(available[0], count))
                 else str(available)) if available else "none"
        raise UsageError(f"unknown layer(s) {bad} for {where}; available layers: {shown}")
    return sorted(out)


def parse_selection(value: Any, max_tokens: int):
    """``(mode, SelectSpec)`` for ``last``, ``all``, a JSON string, a wire dict or a SelectSpec."""
    from vllm_capture.selection import SelectSpec

    if isinstance(value, SelectSpec):
        spec, mode = value, "spec"
    elif isinstance(value, str) and value.strip().lower() == "last":
        spec, mode = SelectSpec(prompt_positions=(-1,)), "last"
    elif isinstance(value, str) and value.strip().lower() == "all":
        spec = SelectSpec.all() if max_tokens > 1 else SelectSpec(prompt="all")
        mode = "all"
    else:
        data = value
        if isinstance(value, str):
            try:
                data = json.loads(value)
            except json.JSONDecodeError as exc:
                raise UsageError(f"--select: expected 'last', 'all' or a SelectSpec JSON object; "
                                 f"invalid JSON ({exc.msg}, column {exc.colno})") from None
        try:
            spec = SelectSpec.from_wire(data)
        except (TypeError, ValueError) as exc:
            raise UsageError(f"--select: invalid SelectSpec: {exc}") from None
        mode = "spec"
    check_selects_something(spec, max_tokens, "--select")
    return mode, spec


def check_selects_something(spec, max_tokens: int, where: str) -> None:
    """UsageError if ``spec`` can capture no row of a request that ``max_tokens`` feeds."""
    reason = spec.selects_nothing_at(max_tokens)
    if reason is not None:
        raise UsageError(f"{where}: {reason}; the selection would capture nothing")


def resolve_storage_dtype_name(value: str | None) -> str | None:
    if value is None:
        return None
    from vllm_capture.session.config import resolve_storage_dtype

    try:
        return dtype_name(resolve_storage_dtype(value))
    except ValueError as exc:
        raise UsageError(f"--storage-dtype: {exc}") from None


# ---- model ---------------------------------------------------------------------------------------

def _looks_like_path(model: str) -> bool:
    return (model.startswith(("/", "./", "../", "~", ".\\")) or model.count("/") > 1
            or model.endswith(("/", ".json", ".safetensors", ".gguf")))


def _model_location(model: str) -> Path | None:
    """Where the model's files are: a local folder or file, or its snapshot folder in the Hugging
    Face cache; None if unknown. UsageError if ``model`` looks like a local path that does not
    exist."""
    path = Path(model).expanduser()
    if path.exists():
        return path
    if _looks_like_path(model):
        raise UsageError(f"model not found: {model} (no such folder)")
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(model, "config.json")
        if isinstance(cached, str):
            return Path(cached).parent
    except Exception:  # noqa: BLE001 - the cache is only a hint; the engine will know
        pass
    return None


def model_config(model: str) -> dict | None:
    """The model's config.json (a local folder, or the Hugging Face cache); None if unknown.

    UsageError if ``model`` looks like a local path that does not exist.
    """
    location = _model_location(model)
    cfg = location / "config.json" if location is not None and location.is_dir() else None
    if cfg is None or not cfg.is_file():
        return None
    try:
        return json.loads(cfg.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None


# The files whose bytes make a model's rows, as vLLM loads them: the weights (safetensors where
# there are any, else PyTorch files, a trainer's own state left out) and the config and tokenizer.
_CONFIG_FILES = frozenset({
    "config.json", "params.json", "generation_config.json", "tokenizer.json",
    "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json",
    "vocab.txt", "merges.txt", "tokenizer.model"})
_TRAINER_FILES = ("optimizer", "scheduler", "training_args", "rng_state")
# Weight files are read in samples: a retrained or newly saved checkpoint changes nearly every
# block of them, and reading a 16 GB checkpoint whole at each start would take tens of seconds.
WEIGHT_SAMPLES = 64
WEIGHT_SAMPLE_BYTES = 4096


def _model_files(folder: Path) -> tuple[list[Path], list[Path]]:
    """``(config and tokenizer files, weight files)`` of a model folder, by name."""
    files = sorted(p for p in folder.iterdir() if p.is_file())
    configs = [p for p in files if p.name in _CONFIG_FILES or p.suffix == ".tiktoken"]
    weights = [p for p in files if p.suffix == ".safetensors"] or [
        p for p in files if p.suffix in (".bin", ".pt", ".pth")
        and not p.name.startswith(_TRAINER_FILES)]
    return configs, weights


def model_files_sha256(model: str) -> str | None:
    """A digest of the model's files: its config and tokenizer files whole, and its weight
    files by name, size and ``WEIGHT_SAMPLES`` evenly spaced blocks (whole where smaller). A
    checkpoint retrained or saved anew in place no longer matches; an edit of a few tensors may
    (it can fall between the blocks). None where the files are not here (a model the engine will
    download, or ``model`` as a label only)."""
    try:
        location = _model_location(model)
    except UsageError:  # a label naming no folder here: extract() takes model as a label
        return None
    if location is None:
        return None
    configs, weights = ([], [location]) if location.is_file() else _model_files(location)
    digest = hashlib.sha256()
    for path in configs:
        digest.update(f"{path.name}\0{sha256_file(path)}\0".encode())
    for path in weights:
        size = path.stat().st_size
        digest.update(f"{path.name}\0{size}\0".encode())
        if size <= WEIGHT_SAMPLES * WEIGHT_SAMPLE_BYTES:
            digest.update(sha256_file(path).encode())
            continue
        with open(path, "rb") as f:
            last = size - WEIGHT_SAMPLE_BYTES
            for i in range(WEIGHT_SAMPLES):
                f.seek(i * last // (WEIGHT_SAMPLES - 1))
                digest.update(f.read(WEIGHT_SAMPLE_BYTES))
    return digest.hexdigest()


def _text_config(config: dict) -> dict:
    inner = config.get("text_config")
    return inner if isinstance(inner, dict) and "num_hidden_layers" in inner else config


def check_model(model: str, components: Sequence[str], layers: list[int] | None) -> dict | None:
    """Validate layers and components against the model's config.json where it is readable."""
    config = model_config(model)
    if config is None:
        return None
    text = _text_config(config)
    num_layers = text.get("num_hidden_layers")
    if isinstance(num_layers, int) and num_layers > 0 and layers is not None:
        resolve_layers(layers, range(num_layers), f"{model} ({num_layers} layers)")
    if ROUTER_LOGITS in components:
        if not any(isinstance(text.get(k, config.get(k)), int) and text.get(k, config.get(k)) > 0
                   for k in _MOE_KEYS):
            raise UsageError(f"component router_logits: {model} is not a mixture-of-experts model "
                             "(its config.json names no experts)")
    return config


# ---- output folder -------------------------------------------------------------------------------

def run_fingerprint(*, model: str, components: Sequence[str], layers: list[int] | None,
                    selection: tuple[str, Any], max_tokens: int, storage_dtype: str | None,
                    engine_dtype: str | None, load_format: str | None,
                    prompts: Sequence[Prompt]) -> dict:
    """What defines a run: two runs with equal fingerprints produce the same rows."""
    mode, spec = selection
    path = Path(model).expanduser()
    return {
        "model": str(path.resolve()) if path.exists() else model,
        "components": list(components),
        "layers": "all" if layers is None else list(layers),
        "selection": {"mode": mode, "spec": spec.to_wire()},
        "max_tokens": int(max_tokens),
        "storage_dtype": storage_dtype,
        "engine_dtype": engine_dtype or "auto",
        # Which weights: "dummy" (random) ones make other rows than the checkpoint's.
        "load_format": load_format or "auto",
        "model_files_sha256": model_files_sha256(model),
        "num_prompts": len(prompts),
        "prompts_sha256": prompts_sha256((p.id, p.text, p.select) for p in prompts),
    }


def check_output(out: str | os.PathLike, fingerprint: dict) -> dict | None:
    """The existing manifest of the same run in ``out`` (None if ``out`` is new or empty).

    UsageError if ``out`` is a file or cannot be created, is a foreign non-empty folder, holds
    a different run, or holds shards that are missing or not the size its manifest says.
    """
    out = Path(out)
    if not out.exists():
        _check_creatable(out)
        return None
    if not out.is_dir():
        raise UsageError(f"--out: {out} exists and is not a folder")
    if not (out / MANIFEST).exists():
        if any(out.iterdir()):
            raise UsageError(f"--out: {out} is not empty and holds no {MANIFEST}; use a new or "
                             "empty folder")
        return None
    try:
        manifest = load_dataset(out).manifest
    except DatasetError as exc:
        raise UsageError(f"--out: {exc}") from None
    # A run written before the fingerprint named its load format used the checkpoint's weights.
    previous = {"load_format": "auto", **manifest.get("run", {})}
    # The model's files are checked where both runs found them (older runs did not hash them).
    files_checked = bool(previous.get("model_files_sha256") and fingerprint["model_files_sha256"])
    differs = [k for k in sorted(set(previous) | set(fingerprint))
               if previous.get(k) != fingerprint.get(k)
               and (k != "model_files_sha256" or files_checked)]
    if differs:
        raise UsageError(f"--out: {out} holds a different run (differs in: {', '.join(differs)}); "
                         "use another --out folder or remove this one")
    return manifest


def _create_folders(out: Path) -> list[Path]:
    """Create the folder ``out`` and the parents it lacks; the folders made, the deepest first.
    UsageError (nothing left made) where it cannot be created: tried for real, as permission
    bits do not tell (root ignores them; read-only and virtual file systems)."""
    missing = []
    existing = Path(os.path.abspath(out))  # without "..": "x/.." exists only once x does
    while not existing.exists():
        missing.append(existing)
        existing = existing.parent
    if not existing.is_dir():
        raise UsageError(f"--out: cannot create {out}: {existing} is a file, not a folder")
    created: list[Path] = []
    try:
        for folder in reversed(missing):
            folder.mkdir()
            created.insert(0, folder)
    except OSError as exc:
        _remove_empty(created)
        raise UsageError(f"--out: cannot create {out}: {exc.strerror} ({exc.filename})") from None
    return created


def _remove_empty(folders: list[Path]) -> None:
    """Remove ``folders`` (the deepest first) while they are empty."""
    for folder in folders:
        if any(folder.iterdir()):
            break
        folder.rmdir()


def _check_creatable(out: Path) -> None:
    """UsageError unless the folder ``out`` can be created (made, then removed again)."""
    _remove_empty(_create_folders(out))


def _clean_leftovers(out: Path, manifest: dict) -> list[str]:
    """Remove shard files an interrupted run left behind (temporary or not in the manifest)."""
    listed = {entry["file"] for entry in manifest.get("shards", [])}
    removed = []
    for child in out.iterdir():
        name = child.name
        ours = name.startswith(SHARD_PREFIX) or name.startswith(f".{SHARD_PREFIX}") or (
            name.startswith(".") and ".tmp-" in name)
        if ours and child.is_file() and name not in listed:
            child.unlink()
            removed.append(name)
    return removed


def _versions() -> dict[str, str]:
    import torch

    try:
        import vllm

        vllm_version = getattr(vllm, "__version__", "unknown")
    except Exception:  # noqa: BLE001
        vllm_version = "unavailable"
    try:
        from importlib.metadata import version

        own = version("vllm-capture")
    except Exception:  # noqa: BLE001
        own = "unknown"
    return {"vllm": vllm_version, "torch": torch.__version__, "vllm_capture": own}


# ---- extraction ----------------------------------------------------------------------------------

class _Buffer:
    """Rows of consecutive batches not yet written, per component; one buffer a shard."""

    def __init__(self, components: Sequence[str], layers: dict[str, list[int]],
                 prompt_start: int):
        self.components = list(components)
        self.layers = layers
        self.prompt_start = prompt_start
        self.prompt_end = prompt_start
        self.tensors = {c: {layer: [] for layer in self.layers[c]} for c in self.components}
        self.labels = {c: {col: [] for col in LABEL_COLUMNS} for c in self.components}
        self.rows = {c: 0 for c in self.components}
        self.prompt_lengths: list[int] = []
        self.nbytes = 0

    def add(self, component: str, result, prompt_start: int) -> int:
        import numpy as np

        counts = np.diff(np.asarray(result.offsets, dtype=np.int64))
        n = int(counts.sum())
        prompt_index = np.repeat(np.arange(prompt_start, prompt_start + len(counts),
                                           dtype=np.int32), counts)
        if n:
            first = result.meta(next(iter(result.layers)))
            positions = first.positions.numpy().astype(np.int32, copy=False)
            token_ids = first.token_ids.numpy().astype(np.int32, copy=False)
        else:
            positions = token_ids = np.empty(0, dtype=np.int32)
        cols = {"prompt_index": prompt_index, "request_id": prompt_index.copy(),
                "position": positions, "token_id": token_ids}
        for col, arr in cols.items():
            self.labels[component][col].append(arr)
            self.nbytes += arr.nbytes
        for layer in self.layers[component]:
            t = result.layers.get(layer)
            if t is None and n:
                raise RuntimeError(f"{component}: capture returned no rows for layer {layer}")
            if not n:
                # An empty layer holds no values; the shard makes its own in the component's
                # dtype (an older worker gives it the engine's: float32 router logits' of a
                # bfloat16 model came as bfloat16).
                continue
            t = t.contiguous()
            self.tensors[component][layer].append(t)
            self.nbytes += t.numel() * t.element_size()
        self.rows[component] += n
        if component == self.components[0]:
            self.prompt_lengths.extend(len(o.prompt_token_ids or ()) for o in result.outputs)
        return n

    def max_rows(self) -> int:
        return max(self.rows.values()) if self.rows else 0

    def tensors_for_shard(self, widths: dict[str, dict[int, int]], dtypes: dict) -> dict:
        """The shard's tensors; a layer without rows is stored empty in ``dtypes[component]``."""
        import numpy as np
        import torch

        from vllm_capture.host_pages import cat_on_huge_pages

        out = {}
        for c in self.components:
            for layer in self.layers[c]:
                parts = self.tensors[c][layer]
                if parts:
                    out[tensor_name(c, layer)] = parts[0] if len(parts) == 1 else \
                        cat_on_huge_pages(parts)
                else:
                    out[tensor_name(c, layer)] = torch.empty((0, widths[c][layer]),
                                                             dtype=dtypes[c])
            for col in LABEL_COLUMNS:
                arr = np.concatenate(self.labels[c][col]) if self.labels[c][col] else \
                    np.empty(0, dtype=np.int32)
                out[label_name(c, col)] = torch.from_numpy(np.ascontiguousarray(arr, dtype=np.int32))
        out[PROMPT_LENGTH] = torch.tensor(self.prompt_lengths, dtype=torch.int32)
        return out


def _write_shard(out: Path, index: int, tensors: dict, metadata: dict[str, str]) -> tuple[str, int, str]:
    from safetensors.torch import save_file

    name = shard_name(index)
    tmp = out / f".{name}.tmp-{os.getpid()}"
    save_file(tensors, str(tmp), metadata=metadata)
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    digest = sha256_file(tmp)
    size = tmp.stat().st_size
    os.replace(tmp, out / name)
    return name, size, digest


@dataclass
class RunPlan:
    """Validated extraction options (everything that can be checked without an engine)."""

    prompts: list[Prompt]
    components: list[str]
    layers: list[int] | None  # requested; None = all, negative = from the end
    mode: str
    spec: Any  # SelectSpec
    max_tokens: int
    storage_dtype: str | None
    batch_size: int
    shard_rows: int
    shard_mb: float
    engine_options: dict

    def fingerprint(self, model: str) -> dict:
        return run_fingerprint(model=model, components=self.components, layers=self.layers,
                               selection=(self.mode, self.spec), max_tokens=self.max_tokens,
                               storage_dtype=self.storage_dtype,
                               engine_dtype=self.engine_options.get("dtype"),
                               load_format=self.engine_options.get("load_format"),
                               prompts=self.prompts)


def plan_run(prompts: Sequence, *, components=(HIDDEN_STATES,), layers=None, select: Any = "last",
             max_tokens: int = 1, storage_dtype: str | None = None, batch_size: int = 32,
             shard_rows: int = 65536, shard_mb: float = 256.0,
             engine_options: dict | None = None) -> RunPlan:
    """Check every option that needs no engine; UsageError on the first bad one."""
    from vllm_capture.selection import SelectSpec

    prompts = _as_prompts(prompts)
    components = parse_components(components)
    requested_layers = parse_layers(layers)
    max_tokens = as_count("--max-tokens", max_tokens, UsageError)
    batch_size = as_count("--batch-size", batch_size, UsageError)
    shard_rows = as_count("--shard-rows", shard_rows, UsageError)
    if isinstance(shard_mb, bool) or not isinstance(shard_mb, (int, float)) or not shard_mb > 0:
        raise UsageError(f"--shard-mb: expected a number > 0, got {shard_mb!r}")
    engine_options = {k: v for k, v in dict(engine_options or {}).items() if v is not None}
    for name in ("tensor_parallel_size", "max_model_len", "max_num_batched_tokens",
                 "max_num_seqs", "capture_buffer_bytes"):
        if name in engine_options:
            as_count("--" + name.replace("_", "-"), engine_options[name], UsageError)
    util = engine_options.get("gpu_memory_utilization")
    if util is not None and not 0 < util <= 1:
        raise UsageError(f"--gpu-memory-utilization: expected a fraction in (0, 1], got {util!r}")
    dtype = engine_options.get("dtype")
    if dtype is not None and dtype not in (known := engine_dtypes()):
        raise UsageError(f"--dtype: expected one of {', '.join(known)}, got {dtype!r}")
    mode, spec = parse_selection(select, max_tokens)
    for p in prompts:
        if p.select is not None:
            check_selects_something(SelectSpec.from_wire(p.select), max_tokens,
                                    f"{describe_prompt(p)} select")
    storage = resolve_storage_dtype_name(storage_dtype)
    return RunPlan(prompts, components, requested_layers, mode, spec, max_tokens, storage,
                   batch_size, shard_rows, shard_mb, engine_options)


def engine_dtypes() -> tuple[str, ...]:
    """The model dtypes vLLM takes by name (its ``ModelDType``)."""
    from vllm.config.model import ModelDType

    return tuple(a for a in get_args(ModelDType) if isinstance(a, str))


def check_prompt_lengths(llm, prompts: Sequence[Prompt], chunk: int = 1024) -> None:
    """UsageError naming the first prompt the engine would refuse as too long (vLLM refuses it
    mid-run, naming no prompt). Counts tokens as vLLM does: the engine's tokenizer, with its
    special tokens."""
    max_len = llm.model_config.max_model_len
    tokenizer = llm.get_tokenizer()
    too_long: list[tuple[Prompt, int]] = []
    for start in range(0, len(prompts), chunk):
        batch = prompts[start: start + chunk]
        ids = tokenizer([p.text for p in batch], add_special_tokens=True)["input_ids"]
        too_long += [(p, len(tokens)) for p, tokens in zip(batch, ids)
                     if len(tokens) >= max_len]
    if too_long:
        prompt, count = too_long[0]
        more = f" ({len(too_long)} prompts are too long)" if len(too_long) > 1 else ""
        # vLLM needs one position past the prompt for the token it generates.
        raise UsageError(f"{describe_prompt(prompt)} has {count} tokens; the engine's "
                         f"max_model_len {max_len} allows at most {max_len - 1}{more}. Shorten "
                         "or remove it, or raise --max-model-len")


def check_batch_dtype(manifest: dict, component: str, layer: int, dtype: str,
                      prompts: tuple[int, int]) -> None:
    """Record ``component``'s dtype at its first captured tensor; DatasetError for a tensor in
    another dtype (one dataset holds one dtype per component, and ``rows()`` would promote)."""
    recorded = manifest["dtypes"][component]
    if recorded is None:
        manifest["dtypes"][component] = dtype
    elif dtype != recorded:
        raise DatasetError(f"{component} layer {layer} of prompts [{prompts[0]}, {prompts[1]}) "
                           f"came back as {dtype}, but this dataset stores {component} as "
                           f"{recorded}: resume on an engine that runs in {recorded}, or extract "
                           "into a new folder")


def _status_layouts(llm, component: str) -> dict[int, dict]:
    from vllm_capture.api import capture_status

    status = capture_status(llm, component)
    return {layer: dict(v) for layer, v in status["layouts"].items()}


@contextlib.contextmanager
def _sole_writer(out: Path) -> Iterator[None]:
    """Hold the folder ``out`` for one run: another ``extract`` into it meanwhile (a second
    process, a scheduler's retry) stops with a UsageError instead of deleting this run's
    temporary shards and writing over its manifest. The lock is the folder's own (``flock``),
    so it goes with the process; a folder made for a run that wrote nothing is removed again."""
    import fcntl

    made = [] if out.exists() else _create_folders(out)
    if not out.is_dir():
        raise UsageError(f"--out: {out} exists and is not a folder")
    fd = os.open(out, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UsageError(f"--out: another extract run is writing into {out}; wait for it "
                             "to finish (a rerun then resumes), or use another folder") from None
        try:
            yield
        finally:
            _remove_empty(made)
    finally:
        os.close(fd)


def extract(llm, prompts: Sequence, out_dir: str | os.PathLike, *, model: str,
            components: Sequence[str] | str = (HIDDEN_STATES,), layers=None,
            select: Any = "last", max_tokens: int = 1, storage_dtype: str | None = None,
            batch_size: int = 32, shard_rows: int = 65536, shard_mb: float = 256.0,
            engine_options: dict | None = None, progress: bool = True,
            on_shard: Callable[[dict], None] | None = None) -> dict:
    """Capture ``prompts`` with the capture-ready engine ``llm`` into the dataset folder ``out_dir``.

    ``prompts`` are strings or :class:`Prompt` records; ``model`` is recorded in the manifest
    (and is part of the run fingerprint). Resumes a matching unfinished run in ``out_dir``.
    ``on_shard(entry)`` is called after each shard is finished (tests use it to interrupt).
    Returns a summary: prompts and rows processed by this call, seconds, prompts/s, rows/s.
    Raises UsageError for bad input, before anything is written, and for an ``out_dir`` that
    another run is writing into; DatasetError for a batch in another dtype than the one the
    dataset records for its component.
    """
    plan = plan_run(prompts, components=components, layers=layers, select=select,
                    max_tokens=max_tokens, storage_dtype=storage_dtype, batch_size=batch_size,
                    shard_rows=shard_rows, shard_mb=shard_mb, engine_options=engine_options)
    with _sole_writer(Path(out_dir)):
        return _extract_planned(llm, plan, out_dir, model=model, progress=progress,
                                on_shard=on_shard)


def _extract_planned(llm, plan: RunPlan, out_dir: str | os.PathLike, *, model: str,
                     progress: bool, on_shard: Callable[[dict], None] | None) -> dict:
    """``extract`` of a checked plan, into a folder the caller holds (``_sole_writer``)."""
    from vllm_capture.api import capture_streams

    prompts, components, requested_layers = plan.prompts, plan.components, plan.layers
    mode, spec, max_tokens, storage = plan.mode, plan.spec, plan.max_tokens, plan.storage_dtype
    batch_size, shard_rows, shard_mb = plan.batch_size, plan.shard_rows, plan.shard_mb
    engine_options = plan.engine_options

    # What the engine offers: layers and layouts per component.
    layer_map: dict[str, list[int]] = {}
    layouts: dict[str, dict[int, dict]] = {}
    for c in components:
        available = _status_layouts(llm, c)
        if not available:
            raise UsageError(f"component {c}: the model has no {c} call sites "
                             "(router_logits needs a mixture-of-experts model)")
        layer_map[c] = resolve_layers(requested_layers, sorted(available), f"{c} of {model}")
        layouts[c] = {layer: available[layer] for layer in layer_map[c]}

    fingerprint = plan.fingerprint(model)
    out = Path(out_dir)  # made and held by _sole_writer
    manifest = check_output(out, fingerprint)
    start = manifest["shards"][-1]["prompt_end"] if manifest and manifest["shards"] else 0
    # The prompts a resumed run finished went through the engine already.
    check_prompt_lengths(llm, prompts[start:])
    if manifest is None:
        manifest = {
            "format": FORMAT, "version": FORMAT_VERSION, "complete": False,
            "run": fingerprint,
            "model": fingerprint["model"], "components": components,
            "layers": {c: layer_map[c] for c in components},
            "layouts": {c: {str(k): v for k, v in layouts[c].items()} for c in components},
            "dtypes": {c: storage for c in components},
            "selection": {"mode": mode, "spec": spec.to_wire(),
                          "per_prompt": sum(p.select is not None for p in prompts)},
            "max_tokens": max_tokens,
            "engine": {k: v for k, v in engine_options.items() if v is not None},
            "extract": {"batch_size": batch_size, "shard_rows": shard_rows, "shard_mb": shard_mb},
            "num_prompts": len(prompts),
            "request_ids": [p.id for p in prompts],
            "rows": {c: 0 for c in components},
            "versions": _versions(),
            "shards": [],
        }
        # The manifest goes first: it marks the folder as this run's (prompts.jsonl is
        # rewritten on resume if an interruption came in between).
        write_json_atomic(out / MANIFEST, manifest)
    else:
        _clean_leftovers(out, manifest)
        manifest["versions"] = _versions()
    if not (out / PROMPTS_FILE).is_file():
        write_text_atomic(out / PROMPTS_FILE, "".join(
            json.dumps({"index": p.index, "id": p.id, "prompt": p.text, "select": p.select}) + "\n"
            for p in prompts))

    shards: list[dict] = manifest["shards"]
    summary = {"out": str(out), "prompts": 0, "rows": 0, "seconds": 0.0, "resumed_at": start,
               "shards_written": 0}
    if start >= len(prompts):
        if not manifest.get("complete"):
            manifest["complete"] = True
            write_json_atomic(out / MANIFEST, manifest)
        return summary

    import torch

    texts = [p.text for p in prompts]
    has_own = any(p.select is not None for p in prompts)
    buffer = _Buffer(components, layer_map, start)
    limit_bytes = shard_mb * (1 << 20)
    widths = {c: {layer: int(layouts[c][layer]["width"]) for layer in layer_map[c]}
              for c in components}
    t0 = time.perf_counter()
    rows_done = 0
    # A shard is written on a thread of its own while the engine runs the next batches: its
    # concatenation, safetensors write, fsync and hash release the GIL. On an H100 that took an
    # extract of every prompt row of 4 layers (16 shards of 256 MiB) from 16 s to 10-11 s. One
    # shard at a time, and the manifest lists a shard only once the one before it is listed and
    # its own file is in place.
    writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vllm-capture-shard")
    pending = None  # (the write's future, the buffer it writes)

    def record_pending() -> None:
        nonlocal pending
        if pending is None:
            return
        (future, written), pending = pending, None
        name, size, digest = future.result()
        entry = {"file": name, "prompt_start": written.prompt_start,
                 "prompt_end": written.prompt_end, "rows": dict(written.rows), "bytes": size,
                 "sha256": digest}
        shards.append(entry)
        for c in components:
            manifest["rows"][c] += written.rows[c]
        manifest["complete"] = written.prompt_end >= len(prompts)
        write_json_atomic(out / MANIFEST, manifest)
        summary["shards_written"] += 1
        if on_shard is not None:
            on_shard(dict(entry))

    def flush() -> None:
        nonlocal buffer, pending
        if buffer.prompt_end == buffer.prompt_start:
            return
        record_pending()
        # A component with no row captured yet has no known dtype; its empty tensors are
        # float32 then (verify does not hold an empty tensor's dtype against the manifest).
        dtypes = {c: getattr(torch, manifest["dtypes"][c] or "float32") for c in components}
        full, buffer = buffer, _Buffer(components, layer_map, buffer.prompt_end)
        shard_widths = {c: dict(w) for c, w in widths.items()}  # the loop updates widths
        index, metadata = len(shards), {"format": FORMAT, "prompt_start": str(full.prompt_start),
                                        "prompt_end": str(full.prompt_end)}
        pending = (writer.submit(lambda: _write_shard(
            out, index, full.tensors_for_shard(shard_widths, dtypes), metadata)), full)

    from tqdm import tqdm

    bar = tqdm(total=len(prompts), initial=start, unit="prompt", desc="extract",
               disable=not progress, file=sys.stderr, dynamic_ncols=True)
    try:
        for b0 in range(start, len(prompts), batch_size):
            b1 = min(b0 + batch_size, len(prompts))
            per_prompt = [p.select for p in prompts[b0:b1]] if has_own else None
            # One generate for every component: their rows are of the same sequences.
            results = capture_streams(llm, texts[b0:b1], {c: layer_map[c] for c in components},
                                      max_tokens=max_tokens, dtype=storage, select=spec,
                                      per_prompt_selects=per_prompt)
            for c, result in results.items():
                for layer, t in result.layers.items():
                    # A layer no selected row reached holds no values to check (an older
                    # worker gives it the engine's dtype), and is not buffered (_Buffer.add).
                    if t.shape[0]:
                        check_batch_dtype(manifest, c, layer, dtype_name(t.dtype), (b0, b1))
                    if layer in widths[c]:
                        widths[c][layer] = int(t.shape[1])
                for layer, lay in (result.layouts or {}).items():
                    if layer in layouts[c]:
                        manifest["layouts"][c][str(layer)] = dict(lay)
                added = buffer.add(c, result, b0)
                if c == components[0]:  # every component stores the same positions
                    rows_done += added
            buffer.prompt_end = b1
            summary["prompts"] += b1 - b0
            elapsed = max(time.perf_counter() - t0, 1e-9)
            bar.update(b1 - b0)
            bar.set_postfix_str(f"{rows_done / elapsed:.1f} rows/s, {len(shards)} shards",
                                refresh=False)
            if buffer.max_rows() >= shard_rows or buffer.nbytes >= limit_bytes:
                flush()
        flush()
        record_pending()
    except BaseException:
        # The shard being written when the run stopped is kept and listed, as if written in
        # line; its own failure (a full disk) must not hide the error in flight.
        try:
            record_pending()
        except Exception as late:  # noqa: BLE001
            print(f"{PROG}: as the run stopped, finishing the shard being written failed too "
                  f"({late!r}); a rerun writes again what the manifest does not list",
                  file=sys.stderr)
        raise
    finally:
        writer.shutdown(wait=True)
        bar.close()
    summary["rows"] = rows_done
    summary["seconds"] = time.perf_counter() - t0
    summary["prompts_per_s"] = summary["prompts"] / max(summary["seconds"], 1e-9)
    summary["rows_per_s"] = rows_done / max(summary["seconds"], 1e-9)
    return summary


# ---- inspect -------------------------------------------------------------------------------------

def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _layer_norms(ds, component: str, layer: int):
    """(mean, min, max) of the rows' L2 norms and per-position (sum, count), one pass."""
    import numpy as np

    total, count, lo, hi = 0.0, 0, math.inf, -math.inf
    pos_sum = np.zeros(0)
    pos_cnt = np.zeros(0)
    for rows, labels in ds.iter_shards(component, layer):
        if rows.shape[0] == 0:
            continue
        norms = rows.float().norm(dim=1).numpy().astype(np.float64)
        total += float(norms.sum())
        count += norms.size
        lo, hi = min(lo, float(norms.min())), max(hi, float(norms.max()))
        pos = labels["position"].astype(np.int64)
        keep = pos >= 0
        if keep.any():
            size = int(pos[keep].max()) + 1
            if size > pos_sum.size:
                pos_sum = np.pad(pos_sum, (0, size - pos_sum.size))
                pos_cnt = np.pad(pos_cnt, (0, size - pos_cnt.size))
            pos_sum[: size] += np.bincount(pos[keep], weights=norms[keep], minlength=size)
            pos_cnt[: size] += np.bincount(pos[keep], minlength=size)
    mean = total / count if count else float("nan")
    return mean, lo, hi, pos_sum, pos_cnt


def _dtypes_text(dtypes: dict[str, str | None]) -> str:
    names = set(dtypes.values())
    if len(names) == 1:
        return str(names.pop())
    return ", ".join(f"{component} {name}" for component, name in dtypes.items())


def summarize(path: str | os.PathLike, stats: bool = True, verify: bool = False) -> str:
    """A human-readable summary of a dataset folder."""
    ds = load_dataset(path, verify=verify)
    m = ds.manifest
    total = m.get("num_prompts", len(m.get("request_ids", [])))
    sel = m.get("selection", {})
    mode = sel.get("mode", "?")
    sel_text = mode if mode != "spec" else json.dumps(
        {k: v for k, v in sel.get("spec", {}).items() if v is not None})
    if sel.get("per_prompt"):
        sel_text += f" ({sel['per_prompt']} prompts with their own select)"
    status = "complete" if ds.complete else "INCOMPLETE (rerun the extract command to resume)"
    v = m.get("versions", {})
    lines = [
        f"dataset    {ds.path}",
        f"model      {m.get('model')}",
        f"status     {status}: {ds.num_prompts}/{total} prompts, {len(ds.shards)} shard(s), "
        f"{_fmt_bytes(ds.size_bytes())}" + (", sha256 verified" if verify else ""),
        f"selection  {sel_text}, max_tokens={m.get('max_tokens')}",
        f"dtype      {_dtypes_text(m['dtypes'])}",
        f"versions   vllm {v.get('vllm')}, torch {v.get('torch')}, "
        f"vllm-capture {v.get('vllm_capture')}",
    ]
    for c in ds.components:
        layers = ds.layers(c)
        lay = ds.layout(c, layers[0]) if layers else {}
        extra = (f" ({lay['num_heads']} heads x {lay['head_size']})"
                 if "num_heads" in lay and "head_size" in lay else "")
        n = ds.num_rows(c)
        lines.append(f"{c}: {n} rows x {len(layers)} layers {layers}, width "
                     f"{lay.get('width')}{extra}; tensor [{n}, {lay.get('width')}] per layer")
        if stats and n:
            lines.append("    layer   mean |x|    min |x|    max |x|")
            for layer in layers:
                mean, lo, hi, _, _ = _layer_norms(ds, c, layer)
                lines.append(f"    {layer:5d} {mean:10.3f} {lo:10.3f} {hi:10.3f}")
    if ds.num_prompts and len(ds):
        c = ds.components[0]
        labels = ds.labels(c, prompt=0)
        pos = labels["position"].tolist()
        toks = labels["token_id"].tolist()
        more = "..." if len(pos) > 12 else ""
        plen = int(ds.prompt_lengths[0])
        gen = sum(p >= plen for p in pos)
        lines.append(f"prompt 0 (id {ds.prompt_ids[0]!r}, {plen} tokens): {len(pos)} {c} rows "
                     f"({len(pos) - gen} prompt, {gen} generated), positions {pos[:12]}{more}, "
                     f"token ids {toks[:12]}{more}")
    ds.close()
    return "\n".join(lines)


def plot_norms(path: str | os.PathLike, out_png: str | os.PathLike,
               components: Sequence[str] | None = None) -> Path:
    """Per-layer mean activation norm by position, one panel per component, as a PNG."""
    try:
        import matplotlib
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.backend_bases import FigureCanvasBase

    out_png = Path(out_png)
    if not out_png.suffix:  # matplotlib would add it: say the name it writes
        out_png = out_png.with_name(out_png.name + ".png")
    formats = FigureCanvasBase.get_supported_filetypes()
    if out_png.suffix[1:].lower() not in formats:
        raise UsageError(f"--plot: cannot write a {out_png.suffix!r} file; use one of "
                         f"{sorted('.' + f for f in formats)}")
    ds = load_dataset(path)
    comps = list(components) if components else ds.components
    fig, axes = plt.subplots(len(comps), 1, figsize=(8, 3.2 * len(comps)), squeeze=False)
    for ax, c in zip(axes[:, 0], comps):
        for layer in ds.layers(c):
            _, _, _, pos_sum, pos_cnt = _layer_norms(ds, c, layer)
            have = pos_cnt > 0
            if not have.any():
                continue
            x = np.flatnonzero(have)
            ax.plot(x, pos_sum[have] / pos_cnt[have], marker="." if len(x) < 64 else None,
                    label=f"layer {layer}")
        ax.set_title(f"{c}: mean L2 norm by position")
        ax.set_xlabel("position")
        ax.set_ylabel("mean ||x||")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize="small", ncol=min(4, len(ax.lines)))
    fig.suptitle(str(ds.manifest.get("model")), fontsize="small")
    fig.tight_layout()
    try:
        out_png.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out_png, dpi=100)
    except OSError as exc:
        raise UsageError(f"--plot: cannot write {out_png}: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)
        ds.close()
    return out_png


# ---- command line --------------------------------------------------------------------------------

class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2
        self.exit(2, f"{PROG}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description="Capture labelled activations (hidden states, attention "
                "heads, router logits) from vLLM into sharded safetensors datasets.")
    sub = p.add_subparsers(dest="command", metavar="{extract,inspect,demo}", parser_class=_Parser)
    sub.required = True

    e = sub.add_parser("extract", help="capture activations of a prompt file into a dataset folder",
                       description="Capture activations of a prompt file into a dataset folder "
                       "(resumable: rerun the same command after an interruption).")
    e.add_argument("model", help="local model folder or a vLLM/Hugging Face model name")
    e.add_argument("prompts", help=".txt (one prompt per line) or .jsonl ({\"prompt\", \"id\"?, "
                   "\"select\"?} per line)")
    e.add_argument("-o", "--out", required=True, help="output folder (created; resumed if it "
                   "holds an unfinished run of the same command)")
    e.add_argument("-c", "--components", action="append", default=None,
                   help=f"comma-separated, repeatable: {', '.join(COMPONENTS)} "
                   "(default hidden_states); one generate per batch captures them all")
    e.add_argument("-l", "--layers", default="all",
                   help="'all' (default) or e.g. 0,2,5-7 (negative: from the last layer)")
    e.add_argument("-s", "--select", default="last",
                   help="'last' (last prompt row, default), 'all' (every prompt row, plus "
                   "generated rows with --max-tokens > 1) or a SelectSpec JSON object")
    e.add_argument("--storage-dtype", default=None,
                   help="float32, float16 or bfloat16 (default: the engine's dtype; vLLM runs a "
                        "float32 checkpoint in bfloat16 unless --dtype float32)")
    e.add_argument("--max-tokens", type=int, default=1,
                   help="tokens to generate per prompt (N gives at most N-1 generated rows: "
                        "fewer when a prompt stops early; default 1)")
    e.add_argument("--batch-size", type=int, default=32, help="prompts per capture call (32)")
    e.add_argument("--shard-rows", type=int, default=65536,
                   help="write a shard once this many rows are buffered (65536)")
    e.add_argument("--shard-mb", type=float, default=256.0,
                   help="... or once this many MiB are buffered (256)")
    e.add_argument("--no-progress", action="store_true", help="no progress bar")
    g = e.add_argument_group("engine options (passed to vllm.LLM)")
    g.add_argument("--tensor-parallel-size", type=int, default=None)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--gpu-memory-utilization", type=float, default=None)
    g.add_argument("--enforce-eager", action="store_true", default=None)
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=None)
    g.add_argument("--dtype", default=None, help="model dtype (auto, float32, bfloat16, ...)")
    g.add_argument("--load-format", default=None,
                   help="vLLM load format; 'dummy' runs a config-only folder with random weights "
                        "(throughput measurements)")
    g.add_argument("--capture-buffer-bytes", type=int, default=None,
                   help="device bytes for capture's ring buffers (default: enough for every row "
                        "of the largest step; less can drop rows of large steps, which fails the run)")

    i = sub.add_parser("inspect", help="summarize a dataset folder (optionally plot norms)")
    i.add_argument("path", help="dataset folder")
    i.add_argument("--plot", default=None, metavar="PNG",
                   help="write per-layer activation norm by position to this PNG")
    i.add_argument("--verify", action="store_true",
                   help="hash every shard and check it, and prompts.jsonl, against the manifest")
    i.add_argument("--no-stats", action="store_true", help="skip the norm statistics (no data read)")

    d = sub.add_parser("demo", help="build a tiny Llama, extract a small dataset on CPU, inspect it")
    d.add_argument("-o", "--out", default="vllm-capture-demo",
                   help="dataset folder (default ./vllm-capture-demo)")
    d.add_argument("--plot", default=None, metavar="PNG", help="also write the norm plot here")
    d.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _default_llm_factory(model: str, components: Sequence[str], engine_options: dict):
    from vllm_capture.api import LLM

    return LLM(model, capture_components=tuple(components), **engine_options)


def _run_extract(model: str, prompts: Sequence, out: str, *, llm_factory: Callable,
                 progress: bool = True, **options) -> dict:
    """Validate everything that can be validated without an engine, then start one and extract.
    The folder is held from before the engine starts (a second run into it stops at once)."""
    plan = plan_run(prompts, **options)
    check_model(model, plan.components, plan.layers)
    with _sole_writer(Path(out)):
        manifest = check_output(out, plan.fingerprint(model))
        if manifest is not None and manifest.get("complete"):
            print(f"{out}: already complete ({manifest['rows'][plan.components[0]]} rows); "
                  "nothing to do", file=sys.stderr)
            return {"out": str(out), "prompts": 0, "rows": 0, "seconds": 0.0,
                    "already_complete": True}
        if manifest is not None:
            done = manifest["shards"][-1]["prompt_end"] if manifest["shards"] else 0
            print(f"{out}: resuming after prompt {done} of {len(plan.prompts)}", file=sys.stderr)
        try:
            llm = llm_factory(model, plan.components, plan.engine_options)
        except ValueError as exc:  # vLLM's checks of its engine arguments (pydantic's too)
            raise UsageError(f"the engine refused its arguments: {' '.join(str(exc).split())}"
                             ) from None
        return _extract_planned(llm, plan, out, model=model, progress=progress, on_shard=None)


def _report(summary: dict) -> None:
    if summary.get("already_complete") or not summary.get("prompts"):
        return
    print(f"captured {summary['rows']} rows from {summary['prompts']} prompts in "
          f"{summary['seconds']:.1f} s ({summary['prompts_per_s']:.1f} prompts/s, "
          f"{summary['rows_per_s']:.0f} rows/s), {summary['shards_written']} shard(s) written",
          file=sys.stderr)


def _joined_layer_lists(argv: Sequence[str]) -> list[str]:
    """``-l -2,-1`` as ``--layers=-2,-1``: argparse takes a value that starts with a dash for an
    option unless it is one negative number."""
    args, i = [], 0
    while i < len(argv):
        value = argv[i + 1] if i + 1 < len(argv) else ""
        if argv[i] in ("-l", "--layers") and _NEGATIVE_FIRST.match(value):
            args.append(f"--layers={value}")
            i += 2
        else:
            args.append(argv[i])
            i += 1
    return args


_NEGATIVE_FIRST = re.compile(r"-[0-9]")


def main(argv: Sequence[str] | None = None, *, llm_factory: Callable | None = None) -> int:
    """Entry point. ``llm_factory(model, components, engine_options)`` builds the engine
    (tests inject a shared one)."""
    args = build_parser().parse_args(_joined_layer_lists(sys.argv[1:] if argv is None else argv))
    factory = llm_factory or _default_llm_factory
    try:
        if args.command == "extract":
            summary = _run_extract(
                args.model, load_prompts(args.prompts), args.out, llm_factory=factory,
                progress=not args.no_progress, components=args.components, layers=args.layers,
                select=args.select, max_tokens=args.max_tokens, storage_dtype=args.storage_dtype,
                batch_size=args.batch_size, shard_rows=args.shard_rows, shard_mb=args.shard_mb,
                engine_options={k: getattr(args, k) for k in _ENGINE_OPTIONS})
            _report(summary)
            print(f"dataset written to {args.out}; inspect it with: {PROG} inspect {args.out}")
            return 0
        if args.command == "inspect":
            print(summarize(args.path, stats=not args.no_stats, verify=args.verify))
            if args.plot:
                print(f"plot written to {plot_norms(args.path, args.plot)}")
            return 0
        if args.command == "demo":
            return _demo(args, factory)
    except (UsageError, DatasetError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted; rerun the same command to resume", file=sys.stderr)
        return 130
    return 2


def _demo(args, factory) -> int:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm_capture import tiny_models

    t0 = time.perf_counter()
    print("vllm-capture demo: building a tiny 4-layer Llama (random weights) ...", flush=True)
    model = str(tiny_models.build("llama"))
    print(f"  model folder: {model}", flush=True)
    print(f"extracting {len(DEMO_PROMPTS)} prompts, components {', '.join(DEMO_COMPONENTS)}, "
          f"every prompt row + {DEMO_MAX_TOKENS - 1} generated rows each "
          "(the engine takes about a minute to start on CPU) ...", flush=True)
    prompts = [Prompt(i, str(i), text) for i, text in enumerate(DEMO_PROMPTS)]
    summary = _run_extract(
        model, prompts, args.out, llm_factory=factory, progress=not args.no_progress,
        components=list(DEMO_COMPONENTS), select="all", max_tokens=DEMO_MAX_TOKENS,
        batch_size=8, shard_rows=64, engine_options=dict(DEMO_ENGINE))
    _report(summary)
    print()
    print(summarize(args.out))
    if args.plot:
        print(f"plot written to {plot_norms(args.out, args.plot)}")
    print()
    print(f"done in {time.perf_counter() - t0:.0f} s. Next:")
    print(f"  {PROG} inspect {args.out} --plot norms.png")
    print(f"  python -c \"import vllm_capture as vc; ds = vc.load_dataset('{args.out}'); "
          "print(ds.rows('hidden_states', 3, prompt=0).shape)\"")
    return 0


if __name__ == "__main__":
    sys.exit(main())
