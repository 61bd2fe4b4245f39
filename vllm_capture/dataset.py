"""Activation datasets on disk: the format ``vllm-capture extract`` writes, and a lazy reader.

Layout of a dataset folder::

    manifest.json                 what was captured, how, and which shards are finished
    prompts.jsonl                 one line per prompt: {"index", "id", "prompt", "select"}
    shard-00000.safetensors       rows of prompts [prompt_start, prompt_end) (see manifest)
    shard-00001.safetensors       ...

Each shard holds, for every captured component ``C`` (``hidden_states``, ``attention_heads``,
``router_logits``) and layer ``L``:

* ``C.layer_L``       ``[rows, width]`` activations in the storage dtype (one row = one token
  position of one prompt; ``attention_heads`` rows are head-major, see the manifest's layouts);
* ``C.prompt_index``  int32 ``[rows]`` index of the prompt in the input file (0-based);
* ``C.request_id``    int32 ``[rows]`` index into the manifest's ``request_ids`` table (the prompts'
  ids: the JSONL ``id`` field, or ``str(prompt_index)``; ids are unique, so this equals
  ``prompt_index``, and ``request_ids[request_id]`` gives the id string);
* ``C.position``      int32 ``[rows]`` absolute sequence position (``position >= prompt length``
  marks a generated row);
* ``C.token_id``      int32 ``[rows]`` the input token id of the row.

and, once per shard, ``prompt_length`` int32 ``[prompt_end - prompt_start]``: the token count of each
prompt of the shard (rows with ``position >= prompt_length[prompt]`` are generated rows).

Every layer of a component shares that component's label columns. Label columns are kept per
component, though one generate per batch captures every component (see ``cli.py``), so every
component holds the same rows.
Inside a shard, rows are grouped by prompt (ascending index) and ordered by position.

Shards are written to a temporary name and renamed once complete; a shard counts only once
``manifest.json`` (also replaced atomically) lists it with its sha256 and size, so a reader never
sees a half-written shard.

The manifest records the storage dtype of each component (``dtypes``): router logits may be
captured in float32 while hidden states are bfloat16. Format version 1 recorded one ``dtype`` for
all components; it is still read, as if each component had that dtype.

Reader API (``vllm_capture.load_dataset``)::

    ds = load_dataset("out/", verify=False)     # verify=True hashes every shard first
    ds.components                                # ["hidden_states", ...]
    ds.layers("hidden_states")                   # [0, 1, 2, 3]
    ds.layout("attention_heads", 0)              # {"width": 128, "num_heads": 4, "head_size": 32}
    ds.dtypes                                    # {"hidden_states": torch.bfloat16, ...}
    ds.dtype                                     # the first component's: torch.bfloat16
    len(ds)                                      # rows of the first component
    ds.num_rows("attention_heads")
    ds.num_prompts, ds.prompt_ids, ds.prompts    # ids table; prompts.jsonl records (lazy)
    ds.prompt_lengths                            # numpy int32 [num_prompts]: tokens per prompt
    ds.rows("hidden_states", 3)                  # every row of layer 3: torch [rows, width]
    ds.rows("hidden_states", 3, prompt=5)        # rows of prompt index 5
    ds.rows("hidden_states", 3, prompt="doc-7")  # ... or of the prompt whose id is "doc-7"
    ds.rows("hidden_states", 3, prompt=[0, 2], positions=range(4))
    ds.labels("hidden_states", prompt=5)         # {"prompt_index", "request_id", "position",
                                                 #  "token_id"}: numpy int32, same rows/order
    for rows, labels in ds.iter_shards("hidden_states", 3): ...   # bounded memory
    ds.verify()                                  # DatasetError unless every shard hashes
                                                 # right and holds what the manifest says

Data is read through ``safetensors.safe_open`` (memory-mapped): only the shards whose prompt range
overlaps the query are opened, and only the row ranges that match are copied out.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np
import torch

from vllm_capture.checks import is_int
from vllm_capture.host_pages import cat_on_huge_pages

FORMAT = "vllm-capture-dataset"
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
MANIFEST = "manifest.json"
PROMPTS_FILE = "prompts.jsonl"
SHARD_PREFIX = "shard-"
SHARD_SUFFIX = ".safetensors"
LABEL_COLUMNS = ("prompt_index", "request_id", "position", "token_id")
PROMPT_LENGTH = "prompt_length"

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# safetensors' names of the dtypes a shard holds.
_FILE_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "I32": "int32"}


class DatasetError(ValueError):
    """A dataset folder is missing, malformed, or fails verification."""


def tensor_name(component: str, layer: int) -> str:
    return f"{component}.layer_{int(layer)}"


def label_name(component: str, column: str) -> str:
    return f"{component}.{column}"


def shard_name(index: int) -> str:
    return f"{SHARD_PREFIX}{index:05d}{SHARD_SUFFIX}"


def prompts_sha256(prompts: Iterable[tuple[str, str, dict | None]]) -> str:
    """Digest of a run's prompts, each ``(id, text, select)``: the manifest's
    ``run.prompts_sha256``, which ``prompts.jsonl`` must match."""
    h = hashlib.sha256()
    for pid, text, select in prompts:
        h.update(json.dumps([pid, text, select], sort_keys=True).encode())
        h.update(b"\n")
    return h.hexdigest()


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON to ``path`` via a temporary file + fsync + rename (never half-written)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def read_manifest(path: str | os.PathLike) -> dict:
    """The manifest of a dataset folder, checked for format; DatasetError if unusable."""
    folder = Path(path)
    if not folder.is_dir():
        raise DatasetError(f"{folder}: no such dataset folder")
    mpath = folder / MANIFEST
    if not mpath.is_file():
        raise DatasetError(f"{folder}: not a vllm-capture dataset (no {MANIFEST})")
    try:
        manifest = json.loads(mpath.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise DatasetError(f"{mpath}: unreadable manifest ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DatasetError(f"{mpath}: not a vllm-capture dataset manifest "
                           f"(format {manifest.get('format') if isinstance(manifest, dict) else None!r})")
    version = manifest.get("version")
    if version not in READABLE_VERSIONS:
        raise DatasetError(f"{mpath}: format version {version!r}; this vllm-capture reads "
                           f"versions {', '.join(map(str, READABLE_VERSIONS))}")
    _check_fields(manifest, str(mpath))
    if version == 1:
        dtype = manifest.pop("dtype")
        manifest["dtypes"] = {component: dtype for component in manifest["components"]}
        manifest["version"] = FORMAT_VERSION
    return manifest


def _is_count(value) -> bool:
    return is_int(value) and value >= 0


def _is_name_list(value) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _is_file_name(value) -> bool:
    return isinstance(value, str) and value not in ("", ".", "..") and \
        os.path.basename(value) == value


def _is_dtype_name(value) -> bool:
    return value is None or value in _DTYPES


def _check_fields(manifest: dict, where: str) -> None:
    """Every field the reader and the extractor read, with its type; DatasetError naming the
    first bad one (a KeyError or TypeError from deep inside a query names none)."""

    def field(container: dict, key: str, expected: str, check, prefix: str = ""):
        """``container[key]`` if ``check`` (a type or a predicate) accepts it."""
        name = f"{prefix}{key}"
        if key not in container:
            raise DatasetError(f"{where}: field {name!r} is missing")
        value = container[key]
        if not (isinstance(value, check) if isinstance(check, type) else check(value)):
            shown = json.dumps(value)
            shown = shown if len(shown) <= 60 else shown[:57] + "..."
            raise DatasetError(f"{where}: field {name!r} must be {expected}, got {shown}")
        return value

    count = "an integer >= 0"
    dtype_names = f"one of {', '.join(_DTYPES)} or null"
    components = field(manifest, "components", "a non-empty list of unique names",
                       lambda v: _is_name_list(v) and v and len(set(v)) == len(v))
    field(manifest, "complete", "true or false", bool)
    field(manifest, "model", "a string", str)
    field(manifest, "max_tokens", count, _is_count)
    field(manifest, "num_prompts", count, _is_count)
    field(manifest, "request_ids", "a list of strings", _is_name_list)
    field(manifest, "versions", "an object", dict)
    field(field(manifest, "run", "an object", dict), "prompts_sha256", "a string", str, "run.")
    selection = field(manifest, "selection", "an object", dict)
    field(selection, "mode", "a string", str, "selection.")
    field(selection, "spec", "an object", dict, "selection.")
    if manifest["version"] == 1:
        field(manifest, "dtype", dtype_names, _is_dtype_name)
    else:
        dtypes = field(manifest, "dtypes", "an object", dict)
        for component in components:
            field(dtypes, component, dtype_names, _is_dtype_name, "dtypes.")
    layers = field(manifest, "layers", "an object", dict)
    layouts = field(manifest, "layouts", "an object", dict)
    rows = field(manifest, "rows", "an object", dict)
    for component in components:
        field(rows, component, count, _is_count, "rows.")
        component_layers = field(layers, component, "a list of layer numbers",
                                 lambda v: isinstance(v, list) and all(map(_is_count, v)),
                                 "layers.")
        component_layouts = field(layouts, component, "an object", dict, "layouts.")
        for layer in component_layers:
            layout = field(component_layouts, str(layer), "an object", dict,
                           f"layouts.{component}.")
            field(layout, "width", count, _is_count, f"layouts.{component}.{layer}.")
    for i, entry in enumerate(field(manifest, "shards", "a list", list)):
        if not isinstance(entry, dict):
            raise DatasetError(f"{where}: field 'shards[{i}]' must be an object")
        prefix = f"shards[{i}]."
        field(entry, "file", "a file name in the dataset folder", _is_file_name, prefix)
        for key in ("prompt_start", "prompt_end", "bytes"):
            field(entry, key, count, _is_count, prefix)
        field(entry, "sha256", "a string", str, prefix)
        shard_rows = field(entry, "rows", "an object", dict, prefix)
        for component in components:
            field(shard_rows, component, count, _is_count, f"{prefix}rows.")


# Iterables that iterate as other values (byte codes, keys): never a list of indices.
_NOT_LISTS = (bytes, bytearray, Mapping)


def _as_index_set(values, name: str) -> np.ndarray:
    if is_int(values):
        arr = np.array([int(values)], dtype=np.int64)
    else:
        try:
            arr = None if isinstance(values, _NOT_LISTS) else np.array(list(values))
        except (TypeError, OverflowError):
            arr = None
        if arr is None or arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
            raise TypeError(f"{name}: expected an int or an iterable of ints, got {values!r}")
    if (arr < 0).any():  # positions count from 0: a negative one would match nothing
        raise ValueError(f"{name}: expected values >= 0, got {values!r}")
    return arr.astype(np.int64)


class CaptureDataset:
    """Lazy, memory-mapped view of an extracted dataset folder (see the module docstring)."""

    def __init__(self, path: str | os.PathLike, verify: bool = False):
        self.path = Path(path)
        self.manifest = read_manifest(self.path)
        self._shards: list[dict] = list(self.manifest.get("shards", []))
        self._handles: dict[str, Any] = {}
        self._labels: dict[tuple[str, str], dict[str, np.ndarray]] = {}
        self._prompts: list[dict] | None = None
        self._id_index: dict[str, int] | None = None
        self._prompt_lengths: np.ndarray | None = None
        self._check_shard_list()
        if verify:
            self.verify()

    def _check_shard_list(self) -> None:
        """The manifest's shards, against one another and the manifest (reads no shard)."""
        where = str(self.path / MANIFEST)
        files = [entry["file"] for entry in self._shards]
        if len(set(files)) != len(files):
            raise DatasetError(f"{where}: a shard is listed twice")
        end = 0
        for entry in self._shards:
            if entry["prompt_start"] != end or entry["prompt_end"] <= end:
                raise DatasetError(f"{where}: shard {entry['file']} holds prompts "
                                   f"[{entry['prompt_start']}, {entry['prompt_end']}), the shard "
                                   f"before it ended at {end} (a shard is missing)")
            end = entry["prompt_end"]
            file = self.path / entry["file"]
            if not file.is_file():
                raise DatasetError(f"{self.path}: shard {entry['file']} listed in the manifest "
                                   "is missing")
            size = file.stat().st_size
            if size != entry["bytes"]:
                raise DatasetError(f"{file}: size {size} bytes, the manifest says "
                                   f"{entry['bytes']} (truncated or replaced)")
        total = len(self.manifest["request_ids"])
        if end > total or (self.complete and end != total):
            raise DatasetError(f"{where}: its shards hold prompts [0, {end}) of {total}"
                               + (", but it says it is complete" if self.complete else ""))
        for component in self.components:
            rows = sum(entry["rows"][component] for entry in self._shards)
            if rows != self.manifest["rows"][component]:
                raise DatasetError(f"{where}: {component}: its shards hold {rows} rows, it says "
                                   f"{self.manifest['rows'][component]}")

    # ---- description -----------------------------------------------------------------------

    @property
    def components(self) -> list[str]:
        return list(self.manifest["components"])

    def _component(self, component: str | None) -> str:
        if component is None:
            return self.components[0]
        if component not in self.manifest["components"]:
            raise KeyError(f"component {component!r} is not in this dataset "
                           f"(it holds {self.components})")
        return component

    def layers(self, component: str | None = None) -> list[int]:
        return [int(x) for x in self.manifest["layers"][self._component(component)]]

    def layout(self, component: str | None, layer: int) -> dict[str, int]:
        component = self._component(component)
        self._check_layer(component, layer)
        return dict(self.manifest["layouts"][component][str(int(layer))])

    @property
    def dtypes(self) -> dict[str, torch.dtype | None]:
        """Storage dtype of each component (None: nothing captured, dtype not known)."""
        names = self.manifest["dtypes"]
        return {c: _DTYPES[names[c]] if names[c] else None for c in self.components}

    @property
    def dtype(self) -> torch.dtype | None:
        """Storage dtype of the first component (see ``dtypes`` for the others)."""
        return self.dtypes[self.components[0]]

    @property
    def complete(self) -> bool:
        return bool(self.manifest.get("complete"))

    @property
    def shards(self) -> list[dict]:
        return [dict(s) for s in self._shards]

    @property
    def num_prompts(self) -> int:
        """Prompts whose rows are in finished shards (all prompts once ``complete``)."""
        return self._shards[-1]["prompt_end"] if self._shards else 0

    @property
    def prompt_ids(self) -> list[str]:
        """The ``request_ids`` table: the id of every prompt, by prompt index."""
        return list(self.manifest["request_ids"])

    @property
    def prompts(self) -> list[dict]:
        """The input prompts (``index``, ``id``, ``prompt``, ``select``), read on first use."""
        if self._prompts is None:
            path = self.path / PROMPTS_FILE
            if not path.is_file():
                raise DatasetError(f"{self.path}: {PROMPTS_FILE} is missing")
            records = []
            with open(path, encoding="utf-8") as f:
                for number, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as exc:
                        raise DatasetError(f"{path}:{number}: not JSON ({exc})") from None
                    if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
                        raise DatasetError(f"{path}:{number}: not a prompt record (an object "
                                           f"with a \"prompt\" string)")
                    records.append(record)
            self._prompts = records
        return self._prompts

    @property
    def prompt_lengths(self) -> np.ndarray:
        """Token count of every prompt in finished shards (reads one small tensor per shard)."""
        if self._prompt_lengths is None:
            parts = [self._handle(e).get_tensor(PROMPT_LENGTH).numpy() for e in self._shards]
            self._prompt_lengths = (np.concatenate(parts) if parts
                                    else np.empty(0, dtype=np.int32))
        return self._prompt_lengths

    def num_rows(self, component: str | None = None) -> int:
        component = self._component(component)
        return int(sum(s["rows"][component] for s in self._shards))

    def __len__(self) -> int:
        return self.num_rows(None)

    def size_bytes(self) -> int:
        return int(sum(s["bytes"] for s in self._shards))

    def __repr__(self) -> str:
        return (f"CaptureDataset({str(self.path)!r}, components={self.components}, "
                f"prompts={self.num_prompts}, rows={len(self)}, shards={len(self._shards)})")

    # ---- verification ----------------------------------------------------------------------

    def verify(self) -> None:
        """Hash every finished shard against the manifest, check that each holds what the
        manifest says, and the prompts file against the run; DatasetError on the first
        mismatch."""
        self._verify_prompts()  # first: the shards' checks read the prompts' selections
        for entry in self._shards:
            file = self.path / entry["file"]
            if not file.is_file():
                raise DatasetError(f"{file}: shard listed in the manifest is missing")
            digest = sha256_file(file)
            if digest != entry["sha256"]:
                raise DatasetError(f"{file}: sha256 {digest[:16]}... does not match the "
                                   f"manifest's {entry['sha256'][:16]}... (file modified or "
                                   "corrupt)")
            self._verify_shard(entry)

    def _verify_shard(self, entry: dict) -> None:
        """A hashed shard's own record of its prompts, its tensors' names, shapes and dtypes,
        and its label columns, against the manifest."""
        where = str(self.path / entry["file"])
        f = self._handle(entry)
        start, end = entry["prompt_start"], entry["prompt_end"]
        meta = f.metadata() or {}
        if (meta.get("prompt_start"), meta.get("prompt_end")) != (str(start), str(end)):
            raise DatasetError(f"{where}: holds prompts [{meta.get('prompt_start')}, "
                               f"{meta.get('prompt_end')}), the manifest says [{start}, {end})")
        want: dict[str, tuple[list[int], str]] = {PROMPT_LENGTH: ([end - start], "int32")}
        for component in self.components:
            rows = entry["rows"][component]
            for layer in self.layers(component):
                width = self.layout(component, layer)["width"]
                want[tensor_name(component, layer)] = ([rows, width],
                                                       self.manifest["dtypes"][component])
            for column in LABEL_COLUMNS:
                want[label_name(component, column)] = ([rows], "int32")
        if set(f.keys()) != set(want):
            raise DatasetError(f"{where}: holds tensors {sorted(set(f.keys()) - set(want))} the "
                               f"manifest does not list and lacks {sorted(set(want) - set(f.keys()))}")
        for name, (shape, dtype) in want.items():
            sl = f.get_slice(name)
            got = (list(sl.get_shape()), _FILE_DTYPES.get(sl.get_dtype(), sl.get_dtype()))
            # An empty tensor holds no values, and one written before its component's first row
            # was captured cannot know the dtype (no dtype in the manifest: nothing captured yet).
            if got[0] != shape or (dtype is not None and shape[0] and got[1] != dtype):
                raise DatasetError(f"{where}: {name} is {got[1]} {got[0]}, the manifest says "
                                   f"{dtype} {shape}")
        lengths = f.get_tensor(PROMPT_LENGTH).numpy().astype(np.int64)
        if (lengths < 1).any():
            raise DatasetError(f"{where}: a prompt_length below 1")
        # A prompt of n tokens and G generated feeds positions 0 .. n + G - 2.
        fed = int(self.manifest["run"].get("max_tokens", 1)) - 1
        first_labels = None
        for component in self.components:
            labels = self._shard_labels(entry, component)
            index = labels["prompt_index"]
            if ((index < start) | (index >= end)).any() or (np.diff(index) < 0).any() or not (
                    np.array_equal(labels["request_id"], index)):
                raise DatasetError(f"{where}: {component}: prompt_index or request_id out of "
                                   f"the shard's prompts [{start}, {end}) or out of order")
            position = labels["position"].astype(np.int64)
            same_prompt = np.diff(index) == 0
            if ((position < 0) | (position >= lengths[index - start] + fed)).any() or (
                    np.diff(position)[same_prompt] <= 0).any():
                raise DatasetError(f"{where}: {component}: a position outside its prompt and "
                                   f"generated tokens, or out of order within a prompt")
            if (labels["token_id"] < 0).any():
                raise DatasetError(f"{where}: {component}: a token_id below 0")
            # Every component holds the rows of the same positions of the same sequences.
            if first_labels is None:
                first_labels = (component, labels)
                self._verify_selected_rows(where, start, lengths, labels)
            elif any(not np.array_equal(labels[c], first_labels[1][c]) for c in LABEL_COLUMNS):
                raise DatasetError(f"{where}: {component}'s label columns differ from "
                                   f"{first_labels[0]}'s")

    def _verify_selected_rows(self, where: str, start: int, lengths: np.ndarray,
                              labels: dict[str, np.ndarray]) -> None:
        """The rows the run's selection promises each prompt of a shard that has no selection
        of its own: ``last``, its last prompt row; ``all``, every position from 0, through its
        prompt at least (``_verify_shard`` bounds the generated ones; fewer where it stopped
        early). A row lost on the way fails here; another selection's rows depend on the
        tokens, and are not checked."""
        mode = self.manifest["selection"]["mode"]
        if mode not in ("last", "all"):
            return
        checked = np.array([r.get("select") is None
                            for r in self.prompts[start:start + lengths.size]], dtype=bool)
        index = labels["prompt_index"].astype(np.int64) - start
        counts = np.bincount(index, minlength=lengths.size)
        firsts = np.cumsum(counts) - counts
        if mode == "last":
            wrong = counts != 1
            wrong[~wrong] = labels["position"][firsts[~wrong]] != lengths[~wrong] - 1
        else:
            wrong = counts < lengths
            offset = labels["position"] - (np.arange(index.size) - firsts[index])
            wrong |= np.bincount(index, weights=offset != 0, minlength=lengths.size) > 0
        bad = np.flatnonzero(wrong & checked)
        if bad.size:
            k = int(bad[0])
            rows = labels["position"][firsts[k]:firsts[k] + counts[k]].tolist()
            raise DatasetError(f"{where}: prompt {start + k} ({lengths[k]} tokens) has rows at "
                               f"positions {rows[:8]}{'...' if len(rows) > 8 else ''}, not what "
                               f"selection {mode!r} keeps")

    def _verify_prompts(self) -> None:
        records = self.prompts
        where = str(self.path / PROMPTS_FILE)
        if [r.get("id") for r in records] != self.prompt_ids:
            raise DatasetError(f"{where}: its prompt ids are not the manifest's request_ids")
        digest = prompts_sha256((r["id"], r["prompt"], r.get("select")) for r in records)
        if digest != self.manifest["run"]["prompts_sha256"]:
            raise DatasetError(f"{where}: the prompts are not the ones this dataset was "
                               "extracted from (run.prompts_sha256 differs)")

    # ---- access ----------------------------------------------------------------------------

    def _check_layer(self, component: str, layer: int) -> None:
        if not is_int(layer):
            raise TypeError(f"layer: expected an int, got {layer!r}")
        if int(layer) not in self.layers(component):
            raise KeyError(f"{component}: layer {layer} is not in this dataset "
                           f"(layers {self.layers(component)})")

    def _handle(self, entry: dict):
        from safetensors import SafetensorError, safe_open

        name = entry["file"]
        if name not in self._handles:
            try:
                self._handles[name] = safe_open(str(self.path / name), framework="pt")
            except (SafetensorError, OSError) as exc:
                raise DatasetError(f"{self.path / name}: unreadable shard ({exc}); "
                                   "load_dataset(path, verify=True) checks every shard") from None
        return self._handles[name]

    def _shard_labels(self, entry: dict, component: str) -> dict[str, np.ndarray]:
        key = (entry["file"], component)
        if key not in self._labels:
            f = self._handle(entry)
            self._labels[key] = {c: f.get_tensor(label_name(component, c)).numpy()
                                 for c in LABEL_COLUMNS}
        return self._labels[key]

    def _prompt_indices(self, prompt) -> np.ndarray | None:
        if prompt is None:
            return None
        if isinstance(prompt, (str, int, np.integer)):
            items = [prompt]
        else:
            try:
                items = None if isinstance(prompt, _NOT_LISTS) else list(prompt)
            except TypeError:
                items = None
            if items is None:
                raise TypeError(f"prompt: expected an index (int), an id (str) or a list of "
                                f"them, got {prompt!r}")
        out = []
        for item in items:
            if isinstance(item, str):
                if self._id_index is None:
                    self._id_index = {pid: i for i, pid in enumerate(self.manifest["request_ids"])}
                if item not in self._id_index:
                    raise KeyError(f"no prompt with id {item!r} in this dataset")
                out.append(self._id_index[item])
            elif is_int(item):
                total = len(self.manifest["request_ids"])
                index = int(item)
                if not -total <= index < total:
                    raise IndexError(f"prompt index {index} out of range for {total} prompts")
                out.append(index % total)
            else:
                raise TypeError(f"prompt: expected an index (int), an id (str) or a list of "
                                f"them, got {item!r}")
        late = [i for i in out if i >= self.num_prompts]
        if late:
            raise IndexError(f"prompt {late[0]} is not extracted yet: this incomplete dataset "
                             f"holds prompts [0, {self.num_prompts}) of "
                             f"{len(self.manifest['request_ids'])}")
        return np.unique(np.array(out, dtype=np.int64))

    def _select(self, component: str, prompt, positions) -> Iterator[tuple[dict, np.ndarray]]:
        """(shard entry, matching row indices) for every shard with matching rows."""
        prompts = self._prompt_indices(prompt)
        wanted_pos = None if positions is None else _as_index_set(positions, "positions")
        for entry in self._shards:
            if prompts is not None:
                lo, hi = entry["prompt_start"], entry["prompt_end"]
                if not ((prompts >= lo) & (prompts < hi)).any():
                    continue
            if entry["rows"][component] == 0:
                continue
            if prompts is None and wanted_pos is None:
                yield entry, np.arange(entry["rows"][component])
                continue
            labels = self._shard_labels(entry, component)
            mask = np.ones(len(labels["position"]), dtype=bool)
            if prompts is not None:
                mask &= np.isin(labels["prompt_index"], prompts)
            if wanted_pos is not None:
                mask &= np.isin(labels["position"], wanted_pos)
            idx = np.flatnonzero(mask)
            if idx.size:
                yield entry, idx

    @staticmethod
    def _read_rows(sl, idx: np.ndarray, total: int) -> torch.Tensor:
        if idx.size == total:
            return sl[:]
        # Read consecutive runs; a scattered selection reads its span once instead.
        breaks = np.flatnonzero(np.diff(idx) != 1) + 1
        starts = np.concatenate([[0], breaks])
        ends = np.concatenate([breaks, [idx.size]])
        if len(starts) <= 32:
            parts = [sl[int(idx[s]): int(idx[e - 1]) + 1] for s, e in zip(starts, ends)]
            return parts[0] if len(parts) == 1 else torch.cat(parts)
        lo = int(idx[0])
        span = sl[lo: int(idx[-1]) + 1]
        return span[torch.from_numpy(idx - lo)]

    def rows(self, component: str | None, layer: int, prompt=None, positions=None) -> torch.Tensor:
        """Activation rows of one layer: all, or those of ``prompt`` (index, id or a list) and/or
        ``positions`` (absolute positions: int or iterable), in dataset order."""
        component = self._component(component)
        self._check_layer(component, layer)
        name = tensor_name(component, layer)
        parts = []
        for entry, idx in self._select(component, prompt, positions):
            sl = self._handle(entry).get_slice(name)
            parts.append(self._read_rows(sl, idx, entry["rows"][component]))
        if not parts:
            width = self.layout(component, layer)["width"]
            return torch.empty((0, width), dtype=self.dtypes[component] or torch.float32)
        return parts[0] if len(parts) == 1 else cat_on_huge_pages(parts)

    def labels(self, component: str | None = None, prompt=None, positions=None) -> dict[str, np.ndarray]:
        """Label columns of the same rows ``rows()`` returns for the same query."""
        component = self._component(component)
        parts = {c: [] for c in LABEL_COLUMNS}
        for entry, idx in self._select(component, prompt, positions):
            labels = self._shard_labels(entry, component)
            for c in LABEL_COLUMNS:
                parts[c].append(labels[c][idx])
        return {c: (np.concatenate(v) if v else np.empty(0, dtype=np.int32))
                for c, v in parts.items()}

    def iter_shards(self, component: str | None, layer: int) -> Iterator[tuple[torch.Tensor, dict[str, np.ndarray]]]:
        """``(rows, labels)`` shard by shard: a full pass over a layer in bounded memory."""
        component = self._component(component)
        self._check_layer(component, layer)
        for entry in self._shards:
            f = self._handle(entry)
            yield (f.get_tensor(tensor_name(component, layer)),
                   {c: f.get_tensor(label_name(component, c)).numpy() for c in LABEL_COLUMNS})

    def close(self) -> None:
        self._handles.clear()
        self._labels.clear()

    def __enter__(self) -> "CaptureDataset":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def load_dataset(path: str | os.PathLike, verify: bool = False) -> CaptureDataset:
    """Open a folder written by ``vllm-capture extract`` (lazily; ``verify=True`` hashes shards)."""
    return CaptureDataset(path, verify=verify)

