"""The whole worker-side data path on CPU, without an engine.

A fake model (3 ``hidden_states`` sites of width 5, fp32, with a residual; 2 ``attention_heads``
sites of width 6, fp16, column-strided views) runs inside a simulated scheduler: chunked prefill,
decode, joins and leaves, preemption (recompute of prompt + generated tokens), prefix-cache hits,
padding rows and dummy requests. Each step goes through the real ``CaptureSession`` and
``CaptureGraphState`` exactly as the runner wrappers drive them (``add_request`` /
``finish_requests`` before the step, ``begin_step(StepBuffers(...))`` with every host token id -1 as the
engine builds it, one ``state.handle`` per site, ``end_step``), and what ``fetch_stream`` returns is
compared with a brute-force reference written here from the SelectSpec definition (the planner is
not used for the reference).

Activation rows are small pseudo-random integers keyed by (request, position, component, layer,
column), exact in fp16 and fp32, so a row attributed to the wrong request, position or layer (or
one missing its residual) is detected.
"""

from __future__ import annotations

import contextlib
import gc
import json
import random
import time
import textwrap
import threading
import types
import warnings
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import vllm_capture.session.config as config_module
from tests.select_reference import selected as reference_selected
from tests.test_selection_spec import select_specs
from vllm_capture.capture_graph.last_rows import store_last_rows
from vllm_capture.capture_graph.state import CaptureGraphState
from vllm_capture.kernels import layout as L
from vllm_capture.selection import SelectSpec, StepBuffers
from vllm_capture.session.session import HARVEST_IDLE_S, CaptureSession
from vllm_capture.session.store import StreamStore
from vllm_capture.session.wire import deserialize_captured

HS, AH = "hidden_states", "attention_heads"
# Forward order of the fake model's call sites: (component, layer, width, dtype).
SITES = (
    (HS, 0, 5, torch.float32),
    (AH, 0, 6, torch.float16),
    (HS, 1, 5, torch.float32),
    (AH, 1, 6, torch.float16),
    (HS, 2, 5, torch.float32),
)
LAYERS = {HS: (0, 1, 2), AH: (0, 1)}
WIDTH = {HS: 5, AH: 6}
DTYPE = {HS: torch.float32, AH: torch.float16}
SALT = {HS: 101, AH: 202}
LAYOUTS = {
    HS: {layer: {"hidden_size": 5} for layer in LAYERS[HS]},
    AH: {layer: {"num_heads": 2, "head_dim": 3} for layer in LAYERS[AH]},
    "router_logits": {},
}
VOCAB = 5  # token ids of the select_specs strategy; every listed token is < VOCAB
MAX_ROWS = 96  # the runner's persistent input_ids buffer


@pytest.fixture(autouse=True)
def _quiet(monkeypatch):
    monkeypatch.setattr(config_module, "_warned_unbounded", True)


# ---- activations ------------------------------------------------------------------------------


def act(num: int, positions, component: str, layer: int) -> np.ndarray:
    """The (x + residual) rows of request ``num`` at ``positions``: ints in [-1000, 1000]."""
    pos = np.asarray(positions, dtype=np.uint64).reshape(-1, 1)
    j = np.arange(WIDTH[component], dtype=np.uint64).reshape(1, -1)
    h = (np.uint64(num) * np.uint64(1000003) + pos * np.uint64(7919) + j * np.uint64(31337)
         + np.uint64(SALT[component] * 613 + layer * 97))
    h = h * np.uint64(0x9E3779B97F4A7C15)
    h ^= h >> np.uint64(29)
    h = h * np.uint64(0xBF58476D1CE4E5B9)
    h ^= h >> np.uint64(31)
    return ((h % np.uint64(2001)).astype(np.int64) - 1000).astype(np.float32)


# ---- the simulated engine ---------------------------------------------------------------------


@dataclass(eq=False)
class Req:
    num: int
    prompt: list
    gen: list  # generated tokens that are fed back (max_tokens - 1 of them)
    client: str = ""
    capture: dict | None = None  # extra_args["capture"]
    arrive: int = 0
    cache_hit: int = 0
    preemptions: int = 0
    resume_hits: bool = False  # a resume after preemption may start on a prefix-cache hit
    computed: int = 0
    known: int = 0
    started: bool = False
    done: bool = False
    rejoin: bool = False  # preempted; re-announced when scheduled again

    def __post_init__(self):
        self.client = self.client or f"c{self.num}"
        self.known = len(self.prompt)

    @property
    def rid(self) -> str:
        return f"{self.client}-{self.num:08x}"

    @property
    def seq(self) -> list:
        return self.prompt + self.gen

    @property
    def total(self) -> int:
        return len(self.prompt) + len(self.gen)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)

    def sampling_params(self):
        extra = {} if self.capture is None else {"capture": self.capture}
        return types.SimpleNamespace(extra_args=extra)


@dataclass
class Entry:
    """One request's rows in one step."""

    req: Req | None  # None: a dummy request the session never heard of
    rid: str
    first: int
    rows: int
    row_start: int


class Engine:
    """CaptureGraphState + CaptureSession driven like the V1 runner wrappers drive them."""

    def __init__(self, capacity=MAX_ROWS, acc_slots=8, ring_slots=2, ids_dtype=torch.int32,
                 host_tokens_rng: random.Random | None = None, rank0_only=(), runner=None):
        self.state = CaptureGraphState(device=torch.device("cpu"), capacity=capacity,
                                       ring_slots=ring_slots, acc_slots=acc_slots,
                                       max_tokens=MAX_ROWS)
        self.counters = []
        for component, layer, width, dtype in SITES:
            counter = self.state.add_site(component, layer, f"model.layers.{layer}.{component}",
                                          width, dtype, last_rows=component == HS)
            self.counters.append((component, layer, counter))
        self.state.allocate()
        self.input_ids = torch.full((MAX_ROWS,), 3, dtype=ids_dtype)
        self.state.set_input_ids(self.input_ids)
        self.session = CaptureSession(self.state, LAYOUTS, rank0_only=rank0_only)
        self.finished: list[Req] = []
        self.step_no = 0
        self.steps: list[list[Entry]] = []
        self.refs: list = []  # reference streams observing every step
        self.noise = np.random.default_rng(1234)
        self.host_tokens_rng = host_tokens_rng
        self.handle_calls = 0
        self.announced: set[str] = set()
        # A fake of vLLM's runner (``_StepV1Runner``, ``_StepV2Runner``), wrapped by wrap_runner:
        # steps then reach the session through the runner wrappers and a scheduler output.
        self.runner = None if runner is None else runner(self)
        if self.runner is not None:
            from vllm_capture.engine.runners import wrap_runner

            assert wrap_runner(self.runner, self.session) is self.input_ids

    def site(self, component, layer):
        return next(s for s in self.state.sites_of(component) if s.layer_id == layer)

    # -- scheduler output ------------------------------------------------------------------------

    def observe(self, batch) -> types.SimpleNamespace:
        """The step's scheduler output (finished and new requests), told to the session here
        unless a runner's wrapper reads it."""
        finished, new = [], []
        if self.finished:
            finished = [r.rid for r in self.finished]
            for ref in self.refs:
                ref.on_finish(finished)
            self.finished = []
        warmups = []  # vLLM's warm-up requests run real steps; only the wrappers see them new
        for req, rows in batch:
            if isinstance(req, str) and req not in self.announced:
                self.announced.add(req)
                warmups.append((req, [5] * rows, None))
            if req is None or isinstance(req, str):
                continue
            if not req.started:
                req.started, req.computed = True, req.cache_hit
                new.append((req.rid, list(req.prompt), req.sampling_params()))
            elif req.rejoin:
                # A resumed request is announced again with everything it has as its "prompt";
                # the session must keep the original prompt length.
                req.rejoin = False
                new.append((req.rid, req.seq[: req.known], req.sampling_params()))
        if self.runner is None:
            if finished:
                self.session.finish_requests(finished)
            for rid, prompt, params in new:
                self.session.add_request(rid, prompt, params)
        return types.SimpleNamespace(
            finished_req_ids=set(finished),
            scheduled_new_reqs=[types.SimpleNamespace(req_id=rid, prompt_token_ids=prompt,
                                                      sampling_params=params)
                                for rid, prompt, params in warmups + new])

    def preempt(self, req: Req, resume_at: int = 0) -> None:
        """``resume_at``: the tokens a prefix-cache hit gives the request when it resumes (other
        requests may have cached more of its sequence than it had computed itself)."""
        req.computed, req.rejoin = resume_at, True

    # -- one step ----------------------------------------------------------------------------------

    def step(self, batch, pad: int = 0) -> list[Entry]:
        """Run one step; ``batch`` is [(Req | dummy-id str, rows)] in batch order."""
        scheduler_output = self.observe(batch)
        entries, row = [], 0
        for req, rows in batch:
            if isinstance(req, str):
                entries.append(Entry(None, req, 5, rows, row))
            else:
                assert not req.done and rows >= 1
                assert req.computed + rows <= min(req.known, req.total), "scheduled unknown tokens"
                entries.append(Entry(req, req.rid, req.computed, rows, row))
            row += rows
        total = row
        padded = total + pad
        assert padded <= MAX_ROWS
        qsl = np.array([0] + [e.row_start + e.rows for e in entries], dtype=np.int32)
        tokens = np.full(total, -1, dtype=np.int32)
        ids = np.asarray(self.noise.integers(0, VOCAB, MAX_ROWS), dtype=np.int64)  # stale/padding
        for e in entries:
            for k in range(e.rows):
                q = e.first + k
                if e.req is not None:
                    ids[e.row_start + k] = e.req.seq[q]
                    if self.host_tokens_rng is not None and self.host_tokens_rng.random() < 0.5:
                        tokens[e.row_start + k] = e.req.seq[q]  # a host that knows the token
        self.input_ids.copy_(torch.from_numpy(ids).to(self.input_ids.dtype))
        step = StepBuffers(
            req_ids=[e.rid for e in entries],
            query_start_loc=qsl,
            num_computed=np.array([e.first for e in entries], dtype=np.int64),
            num_rows_padded=padded,
            token_ids=tokens,
        )
        for ref in self.refs:
            ref.on_step(self.step_no, entries)
        if self.runner is not None:
            scheduler_output.step, scheduler_output.entries = step, entries
            self.runner.execute_model(scheduler_output)
        elif self.session.any_stream_enabled():  # as the runner wrapper does
            self.session.begin_step(step)
            try:
                self.forward(entries, padded)
            finally:
                self.session.end_step()
        else:
            self.forward(entries, padded)
        for e in entries:
            if e.req is None:
                continue
            r = e.req
            r.computed += e.rows
            if r.computed == r.known:  # this step sampled a token
                if r.known == r.total:
                    r.done = True
                    self.finished.append(r)
                else:
                    r.known += 1
        self.steps.append(entries)
        self.step_no += 1
        return entries

    def forward(self, entries, padded: int) -> None:
        for component, layer, counter in self.counters:
            width = WIDTH[component]
            true = self.noise.integers(-3000, 3000, (padded, width)).astype(np.float32)  # padding
            for e in entries:
                if e.req is not None:
                    true[e.row_start:e.row_start + e.rows] = act(
                        e.req.num, range(e.first, e.first + e.rows), component, layer)
            if component == HS:
                residual = self.noise.integers(-500, 500, (padded, width)).astype(np.float32)
                x = torch.from_numpy(true - residual).to(DTYPE[component])
                res = torch.from_numpy(residual).to(DTYPE[component])
            else:
                # A column-strided view, as Inductor may hand over.
                base = torch.zeros((padded, 2 * width), dtype=DTYPE[component])
                x = base[:, ::2]
                x.copy_(torch.from_numpy(true))
                res = None
            self.state.handle(x, res, counter)
            # The eager hook's last-row store (instrument._captured_subclass).
            plan = self.state.last_row_plans.get(component)
            if plan is not None and plan.active:
                store_last_rows(self.state.sites[counter.data_ptr()].last_rows, plan.dest, x, res)
            self.handle_calls += 1

    # -- client side -------------------------------------------------------------------------------

    def fetch(self, component, **kwargs):
        """fetch_stream + deserialize_captured, checked for layouts and per-layer consistency."""
        payload = self.session.fetch_stream(component, **kwargs)
        for layer, info in payload.items():
            assert info["layout"] == LAYOUTS[component][layer]
            assert info["layer_name"] == f"model.layers.{layer}.{component}"
        tensors, metas = deserialize_captured(payload)
        return tensors, metas


def decode_rows(tensors, metas):
    """{layer: [(rid, position, token, values)]} in fetched row order."""
    out = {}
    for layer, tensor in tensors.items():
        m = metas[layer]
        assert tensor.shape[0] == len(m)
        out[layer] = [
            (rid, int(p), int(t), tensor[i].float().numpy())
            for i, (rid, p, t) in enumerate(zip(m.req_ids, m.positions.tolist(),
                                                  m.token_ids.tolist()))
        ]
    return out


# ---- reference ----------------------------------------------------------------------------------


def ref_may_select(spec, prompt_len, position, token) -> bool:
    """Selected for some token, when ``token`` is None (the host could not know it)."""
    if token is not None:
        return reference_selected(spec, prompt_len, position, token)
    return any(reference_selected(spec, prompt_len, position, t) for t in range(VOCAB + 1))


def resolve_select(req: Req, component: str, stream_select):
    """(SelectSpec | None, per-request?) for one request on one stream."""
    raw = req.capture
    if raw is not None:
        if set(raw) <= {HS, AH, "router_logits"}:
            wire = raw.get(component)
        else:
            wire = raw
        if wire is not None:
            return SelectSpec.from_wire(wire), True
    return (None if stream_select is None else SelectSpec.from_wire(stream_select)), False


class RefStream:
    """Independent model of one stream: what every request should yield."""

    def __init__(self, component, acc_slots, reduce="all", select=None, layers=None,
                 active=True):
        self.component = component
        self.active = active  # set when the test enables the stream
        self.reduce = reduce
        self.select = select
        self.layers = tuple(sorted(layers)) if layers is not None else LAYERS[component]
        self.acc_slots = acc_slots
        self.status: dict[str, str] = {}  # rid -> ok | elided | failed
        self.req: dict[str, Req] = {}
        self.first: dict[str, int] = {}
        self.high: dict[str, int] = {}
        self.selected: dict[str, list] = {}  # rid -> [(position, step, row)] in step order
        self.fed: dict[str, list] = {}  # rid -> positions reduced, in order
        self.holding: set[str] = set()  # requests holding an accumulator slot

    def on_finish(self, rids):
        for rid in rids:
            self.holding.discard(rid)

    def on_step(self, step_no, entries):
        if not self.active:
            return
        for e in entries:
            r = e.req
            if r is None:
                continue
            rid = r.rid
            if rid not in self.status:
                self._open(r, e.first)
            if self.status[rid] == "failed":
                continue
            if e.first > self.high[rid] and self._loses_rows(r, self.high[rid], e.first):
                # Positions no step computed (a prefix-cache hit on admission or on resuming).
                self.status[rid] = "elided"
            for k in range(e.rows):
                q = e.first + k
                if q < self.high[rid]:
                    continue  # recomputed after preemption: captured once
                self.fed[rid].append(q)
                if reference_selected(self.spec(r), r.prompt_len, q, r.seq[q]):
                    self.selected[rid].append((q, step_no, e.row_start + k))
            self.high[rid] = max(self.high[rid], e.first + e.rows)

    def spec(self, r):
        return resolve_select(r, self.component, self.select)[0]

    def _open(self, r: Req, first: int):
        rid = r.rid
        self.req[rid], self.first[rid], self.high[rid] = r, first, 0
        self.selected[rid], self.fed[rid] = [], []
        per_request = resolve_select(r, self.component, self.select)[1]
        if per_request and self.reduce != "all":
            self.status[rid] = "failed"
            return
        if self.reduce != "all":
            if len(self.holding) >= self.acc_slots:
                self.status[rid] = "failed"
                return
            self.holding.add(rid)
        self.status[rid] = "ok"

    def _loses_rows(self, r: Req, start: int, stop: int) -> bool:
        """Whether never computing positions ``[start, stop)`` of ``r`` loses what it wanted
        (generated tokens there unknown to the host: any token counts)."""
        if self.reduce == "mean":
            return True
        return self.reduce == "all" and any(
            ref_may_select(self.spec(r), r.prompt_len, q, r.seq[q] if q < r.prompt_len else None)
            for q in range(start, stop))

    def ok(self):
        return sorted(rid for rid, s in self.status.items() if s == "ok")

    def expected_rows(self, rids):
        """{(rid, position)} selected for ``rids``."""
        return {(rid, q) for rid in rids for q, _, _ in self.selected[rid]}


def check_rows(ref: RefStream, rows_by_layer, expected: set):
    """Fetched rows of every layer == ``expected`` (rid, position) pairs; values, tokens right."""
    comp = ref.component
    assert set(rows_by_layer) <= set(ref.layers), "a layer outside the stream's filter came back"
    if not expected:
        assert rows_by_layer == {}
        return
    assert set(rows_by_layer) == set(ref.layers)
    for layer, rows in rows_by_layer.items():
        keys = [(rid, q) for rid, q, _, _ in rows]
        assert len(keys) == len(set(keys)), f"layer {layer}: a row came back twice"
        assert set(keys) == expected, (
            f"layer {layer}: missing {sorted(expected - set(keys))[:8]}, "
            f"unexpected {sorted(set(keys) - expected)[:8]}")
        last_pos: dict[str, int] = {}
        for rid, q, token, values in rows:
            r = ref.req[rid]
            assert token == r.seq[q], f"{rid}@{q}: token label {token} != {r.seq[q]}"
            np.testing.assert_array_equal(values, act(r.num, [q], comp, layer)[0],
                                          err_msg=f"{comp} layer {layer} {rid}@{q}")
            # Each request's rows come back contiguous and position-ordered.
            assert last_pos.get(rid, -1) < q
            last_pos[rid] = q


def merge(collected: dict, rows_by_layer):
    """Accumulate cleared fetches; a row may never come back twice across fetches."""
    for layer, rows in rows_by_layer.items():
        # In one fetch, each request's rows are contiguous.
        order = [rid for rid, _, _, _ in rows]
        runs = [rid for i, rid in enumerate(order) if i == 0 or order[i - 1] != rid]
        assert len(runs) == len(set(runs)), f"layer {layer}: a request's rows are not contiguous"
        bucket = collected.setdefault(layer, [])
        seen = {(rid, q) for rid, q, _, _ in bucket}
        for row in rows:
            assert (row[0], row[1]) not in seen, f"layer {layer}: {row[:2]} fetched twice"
        bucket.extend(rows)


# ---- random scheduler ---------------------------------------------------------------------------


def make_requests(rng: random.Random, count: int, specs, first_num=0, cache_hits=True,
                  max_prompt=10, max_gen=6, preempt=True, arrive_max=6):
    reqs = []
    for i in range(count):
        prompt_len = rng.randint(1, max_prompt)
        capture = None
        spec = specs[i % len(specs)] if specs else None
        if spec is not None and rng.random() < 0.5:
            wire = spec.to_wire()
            capture = wire if rng.random() < 0.6 else {rng.choice([HS, AH]): wire}
        reqs.append(Req(
            num=first_num + i,
            prompt=[rng.randrange(VOCAB) for _ in range(prompt_len)],
            gen=[rng.randrange(VOCAB) for _ in range(rng.randint(0, max_gen))],
            client=f"c{first_num + i}" if rng.random() < 0.8 else "shared",
            capture=capture,
            arrive=rng.randint(0, arrive_max),
            cache_hit=rng.choice([0, 0, 0, rng.randrange(prompt_len)]) if cache_hits else 0,
            preemptions=rng.randint(0, 2) if preempt else 0,
            resume_hits=cache_hits,
        ))
    return reqs


def random_batch(rng: random.Random, engine: Engine, reqs, step_no, max_batch=None):
    """One scheduler decision: preemptions, then (request, rows) in random order, maybe dummies."""
    waiting = [r for r in reqs if r.arrive <= step_no and not r.done]
    for r in waiting:
        if r.started and r.computed and r.preemptions and rng.random() < 0.1:
            r.preemptions -= 1
            resume_at = rng.choice([0, rng.randrange(min(r.known, r.total))])
            engine.preempt(r, resume_at if r.resume_hits else 0)
    batch_reqs = [r for r in waiting if rng.random() < 0.8] or waiting[:1]
    if max_batch is not None:
        batch_reqs = batch_reqs[:max_batch]
    rng.shuffle(batch_reqs)
    batch = []
    for r in batch_reqs:
        start = r.computed if r.started else r.cache_hit
        rows = min(rng.randint(1, 6), min(r.known, r.total) - start)
        batch.append((r, rows))
    if batch and rng.random() < 0.15:
        batch.insert(rng.randrange(len(batch) + 1), (f"_dummy_req_{step_no}", rng.randint(1, 3)))
    return batch


def run_schedule(rng, engine, reqs, on_step=None, max_steps=400, max_batch=None):
    step = 0
    while not all(r.done for r in reqs):
        assert step < max_steps
        if on_step is not None:
            on_step(step)
        batch = random_batch(rng, engine, reqs, step, max_batch)
        if batch:
            engine.step(batch, pad=rng.randint(0, 3))
        step += 1
    return step


# ---- 1. reduce="all": random schedules vs the reference ----------------------------------------


@st.composite
def all_scenarios(draw):
    rng = draw(st.randoms(use_true_random=False))
    specs = draw(st.lists(select_specs(), min_size=0, max_size=3))
    streams = {}
    for component in (HS, AH):
        if component == HS or draw(st.booleans()):
            select = draw(st.none() | select_specs())
            layers = draw(st.none() | st.lists(st.sampled_from(LAYERS[component]), min_size=1,
                                               max_size=2, unique=True))
            enabled_at = draw(st.sampled_from([0, 0, 0, 1, 3, 6]))
            streams[component] = dict(select=None if select is None else select.to_wire(),
                                      layers=layers, enabled_at=enabled_at)
    count = draw(st.integers(1, 6))
    fetch_every = draw(st.sampled_from([None, 2, 5]))
    host_tokens = draw(st.booleans())
    return rng, specs, streams, count, fetch_every, host_tokens


@settings(max_examples=70, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario=all_scenarios())
def test_all_rows_random_schedules_match_the_reference(scenario):
    rng, specs, streams, count, fetch_every, host_tokens = scenario
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # clamped prompt positions
        engine = Engine(acc_slots=4, host_tokens_rng=random.Random(7) if host_tokens else None)
        reqs = make_requests(rng, count, specs)
        refs = {c: RefStream(c, 4, select=cfg["select"], layers=cfg["layers"], active=False)
                for c, cfg in streams.items()}
        engine.refs = list(refs.values())
        collected = {c: {} for c in refs}

        def enable(component):
            cfg = streams[component]
            engine.session.enable_stream(component, select=cfg["select"], layers=cfg["layers"])
            refs[component].active = True

        def on_step(step):
            for component, cfg in streams.items():
                if cfg["enabled_at"] == step:
                    enable(component)
            if fetch_every and step and step % fetch_every == 0:
                for component, ref in refs.items():
                    if not ref.active:
                        continue
                    # Requests clean so far, by engine id or client id.
                    ids = [rid if rng.random() < 0.5 else ref.req[rid].client
                           for rid in ref.ok() if rng.random() < 0.7]
                    ids = [i for i in ids if not _client_is_tainted(ref, i)]
                    if ids:
                        merge(collected[component],
                              decode_rows(*engine.fetch(component, clear=True, req_ids=ids)))

        run_schedule(rng, engine, reqs, on_step)
        for component, ref in refs.items():
            if not ref.active:
                enable(component)  # enabled after everything ran: captures nothing
            ok = ref.ok()
            if ok:
                peek = decode_rows(*engine.fetch(component, clear=False, req_ids=ok))
                drained = decode_rows(*engine.fetch(component, clear=True, req_ids=ok))
                assert _as_keys(peek) == _as_keys(drained)
                merge(collected[component], drained)
            # A request can lose rows (a resume past its progress) after a fetch took some:
            # those are right, but the request's fetches raise from then on.
            late = {layer: [row for row in rows if row[0] not in ok]
                    for layer, rows in collected[component].items()}
            late_keys = _keys(late)
            assert late_keys <= ref.expected_rows(list(ref.status))
            assert all(ref.status[rid] == "elided" for rid, _ in late_keys)
            check_rows(ref, {k: v for k, v in late.items() if v}, late_keys)
            on_time = {layer: [row for row in rows if row[0] in ok]
                       for layer, rows in collected[component].items()}
            check_rows(ref, {k: v for k, v in on_time.items() if v}, ref.expected_rows(ok))
            status = engine.session.stream_status(component)
            assert status["tokens_dropped"] == 0 and status["pending_reductions"] == 0
            elided = [rid for rid, s in ref.status.items() if s == "elided"]
            assert status["cache_elided_reqs"] == len(elided)
            assert status["failed_reqs"] == 0
            if elided:
                with pytest.raises(RuntimeError, match="skip_reading_prefix_cache"):
                    engine.session.fetch_stream(component)
            else:
                assert engine.session.fetch_stream(component) == {}


def _keys(rows_by_layer) -> set:
    return {(rid, q) for rows in rows_by_layer.values() for rid, q, _, _ in rows}


def _as_keys(rows_by_layer):
    return {layer: [(rid, q, t) for rid, q, t, _ in rows] for layer, rows in rows_by_layer.items()}


def _client_is_tainted(ref: RefStream, client_or_rid: str) -> bool:
    """A client id shared with an elided or failed request would make the fetch raise."""
    return any(s != "ok" and (rid == client_or_rid or ref.req[rid].client == client_or_rid)
               for rid, s in ref.status.items())


# ---- 2. ring capacity: cut rows are counted, never silently lost -------------------------------


def _decidable(spec: SelectSpec | None) -> bool:
    """The host decides every row (no condition on a decode token it cannot know)."""
    return spec is None or (spec.generation_tokens is None
                            and spec.exclude_generation_tokens is None)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rng=st.randoms(use_true_random=False), capacity=st.integers(1, 8),
       spec=st.none() | select_specs(), count=st.integers(1, 6))
def test_capacity_cuts_are_counted_per_step(rng, capacity, spec, count):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = Engine(capacity=capacity)
        select = None if spec is None else spec.to_wire()
        ref = RefStream(HS, 8, select=select)
        engine.refs = [ref]
        engine.session.enable_stream(HS, select=select)
        reqs = make_requests(rng, count, [], cache_hits=False)
        total_stored = total_dropped = 0
        dropped_before = 0
        collected = {}
        step = 0
        while not all(r.done for r in reqs):
            batch = random_batch(rng, engine, reqs, step)
            step += 1
            if not batch:
                continue
            engine.step(batch, pad=rng.randint(0, 3))
            dropped = engine.session.stream_status(HS)["tokens_dropped"]
            delta, dropped_before = dropped - dropped_before, dropped
            rows = decode_rows(*engine.fetch(HS, clear=True))
            merge(collected, rows)
            stored = {(rid, q) for rid, q, _, _ in rows.get(0, [])}
            this_step = sorted(((row, (rid, q)) for rid in ref.selected
                                for q, s, row in ref.selected[rid] if s == engine.step_no - 1))
            selected = [key for _, key in this_step]
            # What was kept is a prefix (in row order) of what was selected, within capacity.
            assert len(stored) <= capacity
            assert set(selected[: len(stored)]) == stored
            assert delta >= len(selected) - len(stored)
            if delta == 0:
                assert stored == set(selected)
            if _decidable(spec):
                assert len(stored) == min(capacity, len(selected))
                assert delta == len(selected) - len(stored)
            total_stored += len(stored)
            total_dropped += delta
        everything = ref.expected_rows(ref.ok())
        kept = {(rid, q) for rid, q, _, _ in collected.get(0, [])}
        check_rows(ref, collected, kept)  # values, tokens and layers of what was kept
        assert kept <= everything
        assert total_stored + total_dropped >= len(everything)
        if _decidable(spec):
            assert total_stored + total_dropped == len(everything)


def test_stream_status_names_each_layers_storage_dtype():
    """The site's dtype (float16 heads beside float32 hidden states here), or the stream's own
    once it sets one: what a layer's rows are stored in, so an empty result layer can be too."""
    engine = Engine()
    assert engine.session.stream_status(AH)["dtypes"] == {0: "float16", 1: "float16"}
    assert engine.session.stream_status(HS)["dtypes"] == {0: "float32", 1: "float32",
                                                          2: "float32"}
    engine.session.enable_stream(AH, dtype="bf16")
    assert engine.session.stream_status(AH)["dtypes"] == {0: "bfloat16", 1: "bfloat16"}


def test_the_unbounded_capture_advice_comes_once_from_where_the_stream_is_enabled(monkeypatch,
                                                                                  caplog):
    """Not from a client checking a configuration (capture(), start_capture's check), which
    would print it twice beside a multiprocess engine's worker."""
    monkeypatch.setattr(config_module, "_warned_unbounded", False)
    engine = Engine()
    with caplog.at_level("WARNING"):
        config_module.StreamConfig()
        assert "accumulates in CPU memory" not in caplog.text
        engine.session.enable_stream(HS, budget_rows=5)
        assert "accumulates in CPU memory" not in caplog.text
        engine.session.enable_stream(AH)
        engine.session.enable_stream(HS)
    assert caplog.text.count("accumulates in CPU memory") == 1


def test_a_fetch_of_layers_the_stream_does_not_capture_is_refused_by_name():
    """Layers the model lacks, negative ids and hooked layers the stream leaves out: an error
    naming them, not an empty result (start_capture refuses the same ids)."""
    engine = Engine()
    engine.session.enable_stream(HS, layers=[0, 2])
    for layers in ([99], [-1], [1], [0, 1]):
        with pytest.raises(ValueError, match=r"^layers: \[.*\] are not captured by stream "
                                             r"'hidden_states'; it captures \[0, 2\]"):
            engine.session.fetch_stream(HS, layers=layers)
    engine.session.enable_stream(AH)
    assert engine.session.fetch_stream(AH, layers=[1]) == {}  # every hooked layer captured
    assert engine.session.fetch_stream(HS, layers=[2]) == {}


def test_capacity_example_with_stream_status():
    """Three prompts of 4 rows each in one step, capacity 5: 5 stored, 7 dropped."""
    engine = Engine(capacity=5)
    ref = RefStream(HS, 8)
    engine.refs = [ref]
    engine.session.enable_stream(HS)
    gc.collect()  # as vLLM's start-up does, for seconds on a GPU: before any step, not counted
    assert engine.session.stream_status(HS)["host_timers"]["gc_ms"] == 0
    reqs = [Req(num=i, prompt=[1, 2, 3, 4], gen=[]) for i in range(3)]
    engine.step([(r, 4) for r in reqs], pad=2)
    status = engine.session.stream_status(HS)
    assert status["tokens_stored"] == 5 and status["tokens_dropped"] == 7
    assert status["host_timers"]["fetch_serialize_ms"] == 0
    rows = decode_rows(*engine.fetch(HS))
    check_rows(ref, rows, {(reqs[0].rid, q) for q in range(4)} | {(reqs[1].rid, 0)})
    timers = engine.session.stream_status(HS)["host_timers"]
    assert timers["fetch_wait_ms"] > 0 and timers["fetch_serialize_ms"] > 0
    # The harvest thread's CPU time in storing, beside its wall time (CPU time of one thread
    # cannot pass its wall time; rounding to microseconds aside, and the two clocks apart: the
    # thread's is the scheduler's, and on the CPU VM it read 0.336 ms where the wall's read 0.331).
    assert 0 < timers["harvest_cpu_ms"] <= timers["harvest_ms"] * 1.05 + 0.002
    gc.collect()  # a pause of the whole process, counted where no stage explains it
    assert engine.session.stream_status(HS)["host_timers"]["gc_ms"] > timers["gc_ms"] >= 0


# ---- 3. budget_rows ------------------------------------------------------------------------------


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rng=st.randoms(use_true_random=False), budget=st.integers(0, 25),
       spec=st.none() | select_specs(), count=st.integers(1, 6),
       layers=st.none() | st.just([0, 2]))
def test_budget_rows_per_layer(rng, budget, spec, count, layers):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = Engine()
        select = None if spec is None else spec.to_wire()
        ref = RefStream(HS, 8, select=select, layers=layers)
        engine.refs = [ref]
        engine.session.enable_stream(HS, select=select, budget_rows=budget, layers=layers)
        reqs = make_requests(rng, count, [], cache_hits=False)
        held, dropped, kept_ref, collected = 0, 0, set(), {}
        step = 0
        while not all(r.done for r in reqs):
            batch = random_batch(rng, engine, reqs, step)
            step += 1
            if not batch:
                continue
            engine.step(batch)
            this_step = sorted((row, (rid, q)) for rid in ref.selected
                               for q, s, row in ref.selected[rid] if s == engine.step_no - 1)
            room = max(0, budget - held)
            kept_ref |= {key for _, key in this_step[:room]}
            held += min(room, len(this_step))
            dropped += max(0, len(this_step) - room)
            status = engine.session.stream_status(HS)
            assert status["tokens_stored"] == held <= budget
            assert status["tokens_dropped"] == dropped
            if rng.random() < 0.3:  # a cleared fetch frees the budget
                merge(collected, decode_rows(*engine.fetch(HS, clear=True)))
                held = 0
        merge(collected, decode_rows(*engine.fetch(HS, clear=True)))
        check_rows(ref, collected, kept_ref)
        total = len(ref.expected_rows(ref.ok()))
        assert engine.session.stream_status(HS)["tokens_dropped"] == total - len(kept_ref)


def test_a_budget_keeps_the_rows_planned_first_across_drains_stored_together():
    """Two drains reach the store in one batch. The first came out of the device in the store's
    order (request a's rows, then b's) and kept two of its six rows by a token condition; the
    second holds one row. A budget of two keeps the first drain's two rows: they were planned
    first, whatever their places among the six."""
    from vllm_capture.capture_graph.state import DrainedRows
    from vllm_capture.selection.planner import TokenCondition
    from vllm_capture.session.session import _Drained

    engine = Engine()
    session = engine.session
    session.enable_stream(HS, budget_rows=2)
    stream = session._streams[HS]
    a, b = (stream.store.request_index(f"{r}-00000000") for r in "ab")

    def drain(labels, order=None, condition=None, conditions=()):
        labels = torch.tensor(labels, dtype=torch.int32)
        values = labels[:, 1:2].float().expand(-1, WIDTH[HS]).contiguous()
        rows = DrainedRows(HS, len(labels), {0: (values, labels)}, {0: f"model.layers.0.{HS}"})
        return _Drained(stream, rows, condition, list(conditions), order)

    # Planned (a,0) (b,0) (a,1) (b,1) (a,2) (b,2); token 7 only at (a,0) and (b,2).
    first = drain([[a, 0, 7], [a, 1, 1], [a, 2, 1], [b, 0, 1], [b, 1, 1], [b, 2, 7]],
                  order=np.array([0, 2, 4, 1, 3, 5]), condition=np.zeros(6, dtype=np.int32),
                  conditions=[TokenCondition(frozenset({7}))])
    second = drain([[a, 3, 1]])
    session._store_batch([first, second])
    assert session.stream_status(HS)["tokens_dropped"] == 1
    _, metas = engine.fetch(HS)
    kept = sorted(zip(metas[0].req_ids, metas[0].positions.tolist()))
    assert kept == [("a-00000000", 0), ("b-00000000", 2)]


def test_budget_example_counts_each_row_once():
    engine = Engine()
    ref = RefStream(HS, 8)
    engine.refs = [ref]
    engine.session.enable_stream(HS, budget_rows=3)
    req = Req(num=0, prompt=[1, 2, 3, 4, 0], gen=[2, 3])
    engine.step([(req, 5)])
    engine.step([(req, 1)])
    engine.step([(req, 1)])
    status = engine.session.stream_status(HS)
    assert status["tokens_stored"] == 3 and status["tokens_dropped"] == 4  # once, not per layer
    rows = decode_rows(*engine.fetch(HS))
    assert {layer: len(r) for layer, r in rows.items()} == {0: 3, 1: 3, 2: 3}
    check_rows(ref, rows, {(req.rid, q) for q in range(3)})


# ---- 4. reduce="last" / "mean" ------------------------------------------------------------------


def check_reduced(ref: RefStream, rows_by_layer, rids):
    """One row per request and layer: the final fed row (last) or the mean of all (mean)."""
    comp = ref.component
    if not rids:
        assert rows_by_layer == {}
        return
    assert set(rows_by_layer) == set(ref.layers)
    for layer, rows in rows_by_layer.items():
        assert sorted(rid for rid, _, _, _ in rows) == sorted(rids), f"layer {layer}"
        for rid, q, token, values in rows:
            r, fed = ref.req[rid], ref.fed[rid]
            assert fed and len(fed) == len(set(fed))
            if ref.reduce == "last":
                last = fed[-1]
                assert last == r.total - 1  # the final fed row
                assert (q, token) == (last, r.seq[last])
                np.testing.assert_array_equal(values, act(r.num, [last], comp, layer)[0])
            else:
                assert (q, token) == (-1, -1)
                want = act(r.num, fed, comp, layer).astype(np.float64).mean(axis=0)
                atol = 1e-3 if DTYPE[comp] == torch.float32 else 0.5
                np.testing.assert_allclose(values, want, rtol=1e-3, atol=atol,
                                           err_msg=f"mean {comp} layer {layer} {rid}")


@st.composite
def reduce_scenarios(draw):
    rng = draw(st.randoms(use_true_random=False))
    streams = {HS: dict(reduce=draw(st.sampled_from(["last", "mean"])),
                        layers=draw(st.none() | st.just([1, 2])),
                        enabled_at=draw(st.sampled_from([0, 0, 2])))}
    if draw(st.booleans()):
        streams[AH] = dict(reduce=draw(st.sampled_from(["last", "mean"])), layers=None,
                           enabled_at=0)
    count = draw(st.integers(1, 7))
    # Enough accumulator slots for every request (slot exhaustion: the tests below).
    acc_slots = count + draw(st.integers(0, 2))
    return rng, streams, acc_slots, count, draw(st.booleans()), draw(st.booleans())


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario=reduce_scenarios())
def test_reductions_random_schedules(scenario):
    rng, streams, acc_slots, count, report_finish, with_bad = scenario
    engine = Engine(acc_slots=acc_slots)
    reqs = make_requests(rng, count, [], max_prompt=14, max_gen=5)
    if with_bad:
        # A per-request selection cannot combine with a reduction.
        reqs[0].capture = SelectSpec.all().to_wire()
    refs = {c: RefStream(c, acc_slots, reduce=cfg["reduce"], layers=cfg["layers"], active=False)
            for c, cfg in streams.items()}
    engine.refs = list(refs.values())

    def on_step(step):
        for component, cfg in streams.items():
            if cfg["enabled_at"] == step:
                engine.session.enable_stream(component, reduce=cfg["reduce"],
                                             layers=cfg["layers"])
                refs[component].active = True

    run_schedule(rng, engine, reqs, on_step)
    if report_finish:
        engine.observe([])  # the last finished requests reach the worker (finalized there)
    for component, ref in refs.items():
        if not ref.active:
            continue
        ok = ref.ok()
        status = engine.session.stream_status(component)
        bad = {rid: s for rid, s in ref.status.items() if s != "ok"}
        assert status["failed_reqs"] == sum(s == "failed" for s in bad.values()), ref.status
        assert status["cache_elided_reqs"] == sum(s == "elided" for s in bad.values())
        rows = decode_rows(*engine.fetch(component, req_ids=ok)) if ok else {}
        check_reduced(ref, rows, ok)
        if bad:
            with pytest.raises(RuntimeError) as info:
                engine.session.fetch_stream(component)
            message = str(info.value)
            if "failed" in bad.values():
                assert "failed request" in message
            else:
                assert "skip_reading_prefix_cache" in message


def test_reduce_last_and_mean_example():
    """Two streams, a prompt chunked over three steps, decodes, and a second request joining."""
    engine = Engine(acc_slots=2)
    last, mean = RefStream(HS, 2, reduce="last"), RefStream(AH, 2, reduce="mean")
    engine.refs = [last, mean]
    engine.session.enable_stream(HS, reduce="last")
    engine.session.enable_stream(AH, reduce="mean")
    a = Req(num=0, prompt=[1, 2, 3, 4, 0, 1, 2], gen=[3, 4, 0])
    b = Req(num=1, prompt=[4, 4], gen=[1])
    engine.step([(a, 3)], pad=3)
    engine.step([(a, 3), (b, 2)])
    engine.step([(b, 1), (a, 1)], pad=1)
    engine.step([(a, 1)])
    engine.step([(a, 1)])
    engine.step([(a, 1)])
    assert a.done and b.done
    for ref in (last, mean):
        # b's finish reached the worker at step 3 (finalized there); a's never did.
        assert engine.session.stream_status(ref.component)["pending_reductions"] == 1
        rows = decode_rows(*engine.fetch(ref.component))
        check_reduced(ref, rows, [a.rid, b.rid])
        assert engine.session.stream_status(ref.component)["pending_reductions"] == 0


def test_a_stream_enabled_again_hands_out_clean_slots():
    """Slots are zeroed as they are read. A stream disabled with a reduction still open leaves
    its slot written (never read), and the next stream of that component hands the same slot out
    first: it must start from nothing."""
    engine = Engine(acc_slots=2)
    engine.session.enable_stream(HS, reduce="last")
    engine.session.enable_stream(AH, reduce="mean")
    a = Req(num=0, prompt=[1, 2, 3, 4], gen=[3])
    engine.step([(a, 4)])  # a's rows go into slot 0 of both streams
    engine.session.disable_stream(HS)
    engine.session.disable_stream(AH)
    engine.step([(a, 1)])
    assert a.done
    last, mean = RefStream(HS, 2, reduce="last"), RefStream(AH, 2, reduce="mean")
    engine.refs = [last, mean]
    engine.session.enable_stream(HS, reduce="last")
    engine.session.enable_stream(AH, reduce="mean")
    b = Req(num=1, prompt=[4, 4, 1], gen=[1, 2])
    engine.step([(b, 2)])
    engine.step([(b, 1)])
    engine.step([(b, 1)])
    engine.step([(b, 1)])
    assert b.done
    engine.step([])  # b's finish reaches the worker
    for ref in (last, mean):
        rows = decode_rows(*engine.fetch(ref.component))
        check_reduced(ref, rows, [b.rid])


def test_reductions_finalized_in_several_steps_are_stored_as_one_chunk_per_layer(monkeypatch):
    """Reductions the harvest thread stores together go into one append: a fetch then takes each
    layer's rows whole (one chunk), with the same rows and labels as one append per step."""
    import vllm_capture.session.session as session_module

    monkeypatch.setattr(session_module, "HARVEST_IDLE_S", 60.0)  # store only when asked
    engine = Engine(acc_slots=3)
    ref = RefStream(HS, 3, reduce="last")
    engine.refs = [ref]
    engine.session.enable_stream(HS, reduce="last")
    a, b, c = (Req(num=0, prompt=[1, 2], gen=[3]), Req(num=1, prompt=[4, 4, 4], gen=[1, 2]),
               Req(num=2, prompt=[2], gen=[0, 0, 0]))
    d = Req(num=3, prompt=[1], gen=[2])
    stores = []
    store_reduced = engine.session._store_reduced
    monkeypatch.setattr(engine.session, "_store_reduced",
                        lambda items: stores.append(len(items)) or store_reduced(items))
    engine.step([(a, 2), (b, 3), (c, 1)])
    engine.step([(a, 1), (b, 1), (c, 1)])  # a finishes
    engine.step([(b, 1), (c, 1), (d, 1)])  # d takes a's slot: a's row is read, then b finishes
    engine.step([(c, 1), (d, 1)])  # c and d finish
    engine.step([])
    assert a.done and b.done and c.done and d.done
    engine.session.stream_status(HS)  # stores what the harvest thread holds
    assert stores == [2]  # a's rows, read when d opened, and b's, c's and d's
    store = engine.session._streams[HS].store
    assert store.chunks and all(len(chunks) == 1 for chunks in store.chunks.values())
    check_reduced(ref, decode_rows(*engine.fetch(HS)), [a.rid, b.rid, c.rid, d.rid])


def _last_token_engine_recording_stores(monkeypatch):
    """A last-token engine with two requests, a (one step of decode) and b (two), whose
    reduction stores are recorded as (thread name, request ids)."""
    engine = Engine(acc_slots=3)
    ref = RefStream(HS, 3, reduce="last")
    engine.refs = [ref]
    engine.session.enable_stream(HS, reduce="last")
    stored_by = []
    store_reduced = engine.session._store_reduced

    def recording(items):
        stored_by.append((threading.current_thread().name, [r for i in items for r in i.req_ids]))
        store_reduced(items)

    monkeypatch.setattr(engine.session, "_store_reduced", recording)
    return engine, ref, stored_by, (Req(num=0, prompt=[1, 2], gen=[3]),
                                    Req(num=1, prompt=[4, 4, 4], gen=[1, 2]))


def test_finished_reductions_wait_for_the_fetch_which_reads_and_stores_them_at_once(monkeypatch):
    """Reductions closed in a generate's last steps stay in their slots and their finish markers
    are held, nothing queued: the fetch that follows reads every slot in one device gather and
    stores the rows on its own thread, in one append, instead of waiting for the harvest
    thread."""
    engine, ref, stored_by, (a, b) = _last_token_engine_recording_stores(monkeypatch)
    stream = engine.session._streams[HS]
    reads = []
    read_acc_slots = engine.session.graph_state.read_acc_slots
    monkeypatch.setattr(engine.session.graph_state, "read_acc_slots",
                        lambda component, slots, *args: reads.append(list(slots))
                        or read_acc_slots(component, slots, *args))
    engine.step([(a, 2), (b, 3)])
    engine.step([(a, 1), (b, 1)])  # a finishes, b stays open
    engine.step([(b, 1)])  # a's finish is observed
    engine.step([])  # b's
    assert list(stream.finished) == [a.rid, b.rid] and reads == []
    assert [type(item).__name__ for item in stream.held] == ["_Finish", "_Finish"]
    time.sleep(5 * HARVEST_IDLE_S)  # an idle harvest thread would have stored anything queued
    assert stored_by == []
    rows = decode_rows(*engine.fetch(HS))
    assert len(reads) == 1 and len(reads[0]) == 2
    assert stored_by == [(threading.current_thread().name, [a.rid, b.rid])]
    assert stream.held == [] and stream.finished == {}
    check_reduced(ref, rows, [a.rid, b.rid])


@pytest.mark.parametrize("then", ["status", "next generate"])
def test_held_reductions_go_to_the_harvest_thread_when_the_store_is_needed_first(then):
    """Held reductions are not lost when no fetch comes next: a status (which reports what is
    stored) or new requests opening slots hand them to the harvest thread, and the fetch after
    that returns every request's row."""
    engine = Engine(acc_slots=2)
    ref = RefStream(HS, 3, reduce="last")
    engine.refs = [ref]
    engine.session.enable_stream(HS, reduce="last")
    stream = engine.session._streams[HS]
    a, b = Req(num=0, prompt=[1, 2], gen=[3]), Req(num=1, prompt=[4, 4], gen=[1])
    engine.step([(a, 2), (b, 2)])
    engine.step([(a, 1), (b, 1)])  # both finish
    engine.step([])
    assert stream.held and len(stream.finished) == 2 and stream.free_slots == []
    expected = [a.rid, b.rid]
    if then == "status":
        assert engine.session.stream_status(HS)["tokens_stored"] == 2
        assert stream.held == [] and stream.finished == {}
    else:
        c = Req(num=2, prompt=[2, 0, 1], gen=[4])
        engine.step([(c, 3)])  # takes a slot a or b held: both are read first
        assert stream.held == [] and stream.finished == {}
        engine.step([(c, 1)])
        engine.step([])
        expected.append(c.rid)
    check_reduced(ref, decode_rows(*engine.fetch(HS)), expected)


def test_held_reductions_past_a_harvest_batch_go_to_the_harvest_thread(monkeypatch):
    """A stream holds at most a harvest batch of finish markers for its fetch: requests that
    keep finishing without new ones arriving do not pile up for the fetch to store."""
    import vllm_capture.session.session as session_module

    monkeypatch.setattr(session_module, "HARVEST_BATCH_ITEMS", 2)
    engine, ref, stored_by, (a, b) = _last_token_engine_recording_stores(monkeypatch)
    stream = engine.session._streams[HS]
    c = Req(num=2, prompt=[3, 1], gen=[0, 2, 4])
    engine.step([(a, 2), (b, 3), (c, 2)])
    engine.step([(a, 1), (b, 1), (c, 1)])  # a finishes
    engine.step([(b, 1), (c, 1)])  # a observed: 1 marker held; b finishes
    assert len(stream.held) == 1 and list(stream.finished) == [a.rid]
    engine.step([(c, 1)])  # b observed: 2 markers, a batch, queued with a's and b's rows
    assert stream.held == [] and stream.finished == {}
    engine.step([])  # c observed: held again
    rows = decode_rows(*engine.fetch(HS))
    assert stored_by == [("vllm-capture-harvest", [a.rid, b.rid]),
                         (threading.current_thread().name, [c.rid])]
    check_reduced(ref, rows, [a.rid, b.rid, c.rid])


def test_a_fetch_stores_the_reductions_it_closes_on_its_own_thread(monkeypatch):
    """Requests still open at a fetch (vLLM reports them finished only with its next step) are
    reduced and stored by the fetch itself, with those held since they finished in a step. All
    land in the store once, with the right rows."""
    engine, ref, stored_by, (a, b) = _last_token_engine_recording_stores(monkeypatch)
    engine.step([(a, 2), (b, 3)])
    engine.step([(a, 1), (b, 1)])  # a finishes
    engine.step([(b, 1)])  # a's finish is observed; b finishes, unobserved
    rows = decode_rows(*engine.fetch(HS))
    assert stored_by == [(threading.current_thread().name, [a.rid, b.rid])]  # a's was held
    check_reduced(ref, rows, [a.rid, b.rid])
    assert engine.session.stream_status(HS)["host_timers"]["fetch_store_ms"] > 0


def test_on_stored_hears_open_reductions_before_their_rows_arrive():
    """A last-token stream stores nothing until its requests finish: the worker hears what they
    will take as soon as they open, so its reply file grows during the generate."""
    engine = Engine(acc_slots=3)
    heard = []
    engine.session.on_stored = heard.append
    engine.session.enable_stream(HS, reduce="last")
    a, b = Req(num=0, prompt=[1, 2], gen=[3, 1]), Req(num=1, prompt=[4, 4], gen=[1, 2])
    engine.step([(a, 2), (b, 2)])
    engine.session.stream_status(HS)  # waits for the harvest thread
    st = engine.session._streams[HS]
    row_bytes = engine.session.graph_state.streams[HS].row_bytes
    assert st.store.bytes_stored == 0 and row_bytes > 0
    assert heard == [2 * row_bytes]


@pytest.mark.parametrize("finish", ["together", "later request first"])
def test_reductions_read_together_are_stored_in_their_host_copy_not_copied_again(finish):
    """The host copy of the closed reductions read in one gather (one block for a ring group's
    layers) was made for the store alone: its chunks are that block's rows, and they fetch like
    copies. Requests that finished out of their registration order are gathered in that order,
    so the store keeps the block as it is then too."""
    engine = Engine(acc_slots=3)
    ref = RefStream(HS, 3, reduce="last")
    engine.refs = [ref]
    engine.session.enable_stream(HS, reduce="last")
    a = Req(num=0, prompt=[1, 2], gen=[3] if finish == "together" else [3, 1])
    b = Req(num=1, prompt=[4, 4], gen=[1])
    engine.step([(a, 2), (b, 2)])
    engine.step([(a, 1), (b, 1)])  # b finishes (and a, together)
    if finish != "together":
        engine.step([(a, 1)])  # a finishes
        assert list(engine.session._streams[HS].finished) == [b.rid]
    engine.step([])
    engine.session.stream_status(HS)
    store = engine.session._streams[HS].store
    storages = {chunk.tensor.untyped_storage().data_ptr()
                for chunks in store.chunks.values() for chunk in chunks.values()}
    assert len(store.chunks) > 1 and len(storages) == 1
    check_reduced(ref, decode_rows(*engine.fetch(HS)), [a.rid, b.rid])


def test_on_stored_hears_the_largest_active_streams_bytes_after_each_harvest():
    """The worker grows its spare reply file (shm.want_spare) from these reports."""
    engine = Engine()
    heard = []
    engine.session.on_stored = heard.append
    engine.session.enable_stream(HS)
    engine.session.enable_stream(AH, layers=[0])
    a = Req(num=0, prompt=[1, 2, 3, 4, 0, 1, 2], gen=[3, 4])
    engine.step([(a, 4)])
    engine.step([(a, 3)])
    engine.session.clear_stream(AH)  # drains and waits for the harvest
    stores = [engine.session._streams[c].store for c in (HS, AH)]
    assert heard and heard[-1] == stores[0].bytes_stored > 0 and stores[1].bytes_stored == 0
    assert heard == sorted(heard)  # rows only arrive


@pytest.mark.parametrize("reduce", ["all", "last"])
def test_a_rank_that_does_not_own_a_replicated_stream_copies_nothing(reduce):
    """Tensor parallelism: rank 1 runs the same steps with hidden states left to rank 0; its
    heads (sharded, so captured on every rank) match rank 0's rows exactly."""
    fetched = []
    for engine in (Engine(), Engine(rank0_only=(HS,))):
        for stream in (HS, AH):
            engine.session.enable_stream(stream, reduce=reduce)
        a = Req(num=0, prompt=[1, 2, 3, 4, 0, 1, 2], gen=[3, 4])
        b = Req(num=1, prompt=[4, 4], gen=[1])
        engine.step([(a, 4)], pad=2)
        engine.step([(a, 3), (b, 2)])
        engine.step([(a, 1), (b, 1)])
        engine.step([(a, 1)])
        assert a.done and b.done
        fetched.append((engine, {c: decode_rows(*engine.fetch(c)) for c in (HS, AH)}))
    (rank0, rows0), (rank1, rows1) = fetched
    assert all(int(s.counter[L.SITE_ENABLED]) == 0 for s in rank1.state.sites_of(HS))
    assert rows1[HS] == {} and rank1.session.stream_status(HS)["tokens_stored"] == 0
    assert sum(len(v) for v in rows0[HS].values()) > 0
    assert rows1[AH].keys() == rows0[AH].keys()
    for layer, rows in rows0[AH].items():
        assert [r[:3] for r in rows1[AH][layer]] == [r[:3] for r in rows]
        assert all(np.array_equal(x[3], y[3]) for x, y in zip(rows1[AH][layer], rows))


def test_more_concurrent_requests_than_slots_fail_at_fetch():
    engine = Engine(acc_slots=2)
    ref = RefStream(HS, 2, reduce="mean")
    engine.refs = [ref]
    engine.session.enable_stream(HS, reduce="mean")
    reqs = [Req(num=i, prompt=[1, 2, 3], gen=[4]) for i in range(3)]
    engine.step([(r, 3) for r in reqs])
    engine.step([(r, 1) for r in reqs])
    assert ref.status == {reqs[0].rid: "ok", reqs[1].rid: "ok", reqs[2].rid: "failed"}
    with pytest.raises(RuntimeError, match=r"more concurrent requests than reduce slots \(2\)"):
        engine.session.fetch_stream(HS)
    check_reduced(ref, decode_rows(*engine.fetch(HS, req_ids=[reqs[0].rid, reqs[1].client])),
                  [reqs[0].rid, reqs[1].rid])




def test_a_request_that_failed_for_a_slot_does_not_take_one_later():
    engine = Engine(acc_slots=1)
    engine.session.enable_stream(HS, reduce="last")
    a = Req(num=0, prompt=[1, 2], gen=[])  # holds the only slot, done after step 0
    b = Req(num=1, prompt=[1, 2], gen=[3, 4, 0])  # finds no slot at step 0: failed
    c = Req(num=2, prompt=[3], gen=[1])  # joins once a's finish freed the slot
    engine.step([(a, 2), (b, 2)])
    engine.step([(b, 1), (c, 1)])  # a's finish reaches the worker first
    engine.step([(b, 1), (c, 1)])
    engine.step([(b, 1)])
    assert engine.session.stream_status(HS)["failed_reqs"] == 1  # b only
    rows = decode_rows(*engine.fetch(HS, req_ids=[a.rid, c.rid]))
    assert sorted(rid for rid, _, _, _ in rows[0]) == sorted([a.rid, c.rid])


def test_a_request_that_failed_for_a_slot_is_not_also_elided():
    engine = Engine(acc_slots=1)
    engine.session.enable_stream(HS, reduce="mean")
    a = Req(num=0, prompt=[1, 2], gen=[])
    b = Req(num=1, prompt=[1, 2], gen=[3, 4])
    engine.step([(a, 2), (b, 2)])
    engine.step([(b, 1)])
    status = engine.session.stream_status(HS)
    assert (status["failed_reqs"], status["cache_elided_reqs"]) == (1, 0)


def test_fetching_a_reduce_stream_while_requests_run_keeps_the_step_path_alive():
    engine = Engine(acc_slots=4)
    engine.session.enable_stream(HS, reduce="last")
    a = Req(num=0, prompt=[1, 2, 3], gen=[4, 0])
    engine.step([(a, 3)])
    engine.fetch(HS)  # a client drains while a request is still decoding
    engine.step([(a, 1)])
    engine.step([(a, 1)])


@pytest.mark.parametrize("reduce", ["last", "mean"])
@pytest.mark.parametrize("bad", [{"req_ids": "17"}, {"layers": 0}])
def test_a_refused_fetch_leaves_running_reductions_open(reduce, bad):
    # A bare string as req_ids would match its characters ("7" is the request's client id);
    # refused before the fetch closes anything, the reduction still covers every position.
    engine = Engine(acc_slots=4)
    ref = RefStream(HS, 2, reduce=reduce)
    engine.refs = [ref]
    engine.session.enable_stream(HS, reduce=reduce)
    a = Req(num=0, prompt=[1, 2, 3], gen=[4, 5, 0], client="7")
    engine.step([(a, 3)])
    with pytest.raises(ValueError, match=next(iter(bad))):
        engine.session.fetch_stream(HS, **bad)
    engine.step([(a, 1)])
    engine.step([(a, 1)])
    engine.step([(a, 1)])
    engine.step([])
    check_reduced(ref, decode_rows(*engine.fetch(HS)), [a.rid])


@pytest.mark.parametrize("reduce", ["last", "mean"])
@pytest.mark.parametrize("clear", [True, False])
def test_a_fetch_before_a_request_ends_ends_its_reduction_and_counts_the_rows_after(reduce, clear):
    engine = Engine(acc_slots=4)
    engine.session.enable_stream(HS, reduce=reduce)
    a = Req(num=0, prompt=[1, 2, 3], gen=[4, 5, 0])  # rows at positions 0-5
    b = Req(num=1, prompt=[6, 7], gen=[])  # done in the first step, heard of at the next
    engine.step([(a, 3), (b, 2)])
    early = decode_rows(*engine.fetch(HS, clear=clear))
    assert {rid for rid, _, _, _ in early[1]} == {a.rid, b.rid}
    assert engine.session.stream_status(HS)["tokens_dropped"] == 0
    for _ in range(3):
        engine.step([(a, 1)])  # positions 3, 4, 5: computed, no longer reduced
    engine.step([])
    assert engine.session.stream_status(HS)["tokens_dropped"] == 3
    later = decode_rows(*engine.fetch(HS))
    # Nothing more of a: what the first fetch returned, again only where it kept the rows.
    assert sorted(rid for rid, _, _, _ in later.get(1, [])) == ([] if clear else
                                                               sorted([a.rid, b.rid]))
    want = act(0, range(3), HS, 1)
    got = [values for rid, _, _, values in early[1] if rid == a.rid][0]
    if reduce == "last":
        np.testing.assert_array_equal(got, want[-1])
    else:
        np.testing.assert_allclose(got, want.astype(np.float64).mean(axis=0), rtol=1e-3, atol=0.5)


@pytest.mark.parametrize("reduce", ["last", "mean"])
def test_rows_a_request_recomputes_below_its_cut_are_not_counted_dropped(reduce):
    """A fetch cut a's reduction after positions 0-4; a preemption then recomputes 0-4 (which
    it took) and computes 5 and 6 (which it did not): 2 dropped, and a second preemption
    counts none of them again."""
    engine = Engine(acc_slots=4)
    engine.session.enable_stream(HS, reduce=reduce)
    a = Req(num=0, prompt=[1, 2, 3, 4], gen=[5, 6, 7, 0])
    engine.step([(a, 4)])
    engine.step([(a, 1)])  # position 4
    decode_rows(*engine.fetch(HS, req_ids=[a.rid]))
    engine.preempt(a)
    engine.step([(a, 6)])  # positions 0-5
    engine.step([(a, 1)])  # position 6
    assert engine.session.stream_status(HS)["tokens_dropped"] == 2
    engine.preempt(a)
    engine.step([(a, 7)])  # positions 0-6 again
    assert engine.session.stream_status(HS)["tokens_dropped"] == 2


@pytest.mark.parametrize("reduce", ["last", "mean"])
def test_a_resume_past_the_cut_counts_only_the_rows_it_computes(reduce):
    """Cut after positions 0-4; the resume starts on a prefix-cache hit at 7 (5 and 6 are never
    computed): 7 and 8 are dropped, 2 in all, and a later full recompute adds none."""
    engine = Engine(acc_slots=4)
    engine.session.enable_stream(HS, reduce=reduce)
    a = Req(num=0, prompt=list(range(10)), gen=[1, 0])
    engine.step([(a, 4)])
    engine.step([(a, 1)])  # position 4
    decode_rows(*engine.fetch(HS, req_ids=[a.rid]))
    engine.preempt(a, resume_at=7)
    engine.step([(a, 2)])  # positions 7, 8
    assert engine.session.stream_status(HS)["tokens_dropped"] == 2
    engine.preempt(a)
    engine.step([(a, 9)])  # positions 0-8 again
    assert engine.session.stream_status(HS)["tokens_dropped"] == 2


@pytest.mark.parametrize("told_finished", [False, True])
def test_a_clear_keeps_an_elision_while_its_mean_holds_a_slot(told_finished):
    """Preempted (out of the batch, its slot kept), a's elision outlives a clear and its fetch
    raises; told finished before the clear, its partial mean goes with the clear, and the
    elision with it: nothing returned, nothing raised."""
    engine = Engine()
    engine.session.enable_stream(HS, reduce="mean")
    a = Req(num=0, prompt=[0, 1, 2, 3], gen=[1, 2, 0], cache_hit=2)
    engine.step([(a, 2)])  # positions 2, 3: 0 and 1 came from the prefix cache
    if told_finished:
        engine.step([(a, 1)])
        engine.session.finish_requests([a.rid])
    else:
        engine.preempt(a)
    engine.session.clear_stream(HS)
    assert engine.session.stream_status(HS)["cache_elided_reqs"] == int(not told_finished)
    if told_finished:
        assert decode_rows(*engine.fetch(HS, req_ids=[a.rid])) == {}
    else:
        with pytest.raises(RuntimeError, match="skip_reading_prefix_cache"):
            engine.session.fetch_stream(HS, req_ids=[a.rid])


def test_clearing_a_mean_stream_keeps_a_running_requests_elision():
    """a's mean lacks positions 0 and 1 (a prefix-cache hit): a clear while it runs must not
    let that mean, over positions 2-5 only, be fetched as if whole."""
    engine = Engine()
    engine.session.enable_stream(HS, reduce="mean")
    a = Req(num=0, prompt=[0, 1, 2, 3], gen=[1, 2, 0], cache_hit=2)
    engine.step([(a, 2)])
    assert engine.session.stream_status(HS)["cache_elided_reqs"] == 1
    engine.session.clear_stream(HS)
    engine.step([(a, 1)])
    engine.step([(a, 1)])
    engine.step([])
    assert engine.session.stream_status(HS)["cache_elided_reqs"] == 1
    with pytest.raises(RuntimeError, match="skip_reading_prefix_cache"):
        engine.session.fetch_stream(HS)


def test_a_request_id_reused_while_its_rows_are_held_fails_that_id_only():
    # vLLM makes ids unique unless VLLM_DISABLE_REQUEST_ID_RANDOMIZATION is set; then a client
    # may send an id again as soon as its first request finished.
    engine = Engine()
    ref = RefStream(HS, 8)
    engine.refs = [ref]
    engine.session.enable_stream(HS)
    first = Req(num=0, prompt=[1, 2, 3], gen=[], client="r")
    again = Req(num=0, prompt=[4, 0, 1, 2], gen=[3, 0], client="r")
    other = Req(num=1, prompt=[5, 6], gen=[7, 8, 0])
    assert first.rid == again.rid
    engine.step([(first, 3), (other, 2)])
    engine.step([(again, 4), (other, 1)])  # first's finish and again's arrival: one step
    engine.step([(again, 1), (other, 1)])
    engine.step([(again, 1), (other, 1)])
    engine.step([])
    with pytest.raises(RuntimeError, match="request id reused while the stream still holds"):
        engine.session.fetch_stream(HS)
    rows = decode_rows(*engine.fetch(HS, req_ids=[other.rid]))
    for layer in LAYERS[HS]:
        assert [(rid, q) for rid, q, _, _ in rows[layer]] == [(other.rid, q) for q in range(5)]
        for rid, q, _, values in rows[layer]:
            np.testing.assert_array_equal(values, act(other.num, [q], HS, layer)[0])


def test_a_request_id_given_again_after_its_rows_were_fetched_is_captured():
    engine = Engine()
    engine.session.enable_stream(HS)
    first = Req(num=0, prompt=[1, 2, 3], gen=[], client="r")
    again = Req(num=0, prompt=[4, 0, 1], gen=[2, 0], client="r")
    engine.step([(first, 3)])
    engine.step([])  # the worker hears that first finished
    engine.fetch(HS)  # and its rows leave the store
    engine.step([(again, 3)])
    engine.step([(again, 1)])
    engine.step([])
    rows = decode_rows(*engine.fetch(HS))
    for layer in LAYERS[HS]:
        assert [(rid, q, t) for rid, q, t, _ in rows[layer]] == [
            (again.rid, q, t) for q, t in enumerate([4, 0, 1, 2])]


@pytest.mark.parametrize("capacity, acc_slots", [(95, 6), (93, 1), (96, 8)])
def test_every_sites_buffers_start_16_byte_aligned_and_keep_their_rows(capacity, acc_slots):
    """Triton specializes the kernel on its buffers' 16-byte alignment, and the variants are
    compiled for aligned ones before graph capture. Sites share a group's tensors, so an odd row
    count (max_num_batched_tokens) or slot count (max_num_seqs), or a width, would move the next
    site's part off that alignment. Rows and reductions still come back right from each site."""
    engine = Engine(capacity=capacity, acc_slots=acc_slots)
    for site in engine.state.sites.values():
        for name in ("ring", "ring_labels", "acc", "acc_labels", "acc_count"):
            t = getattr(site, name)
            assert t.data_ptr() % 16 == 0 and t.is_contiguous(), (
                site.component, site.layer_id, name)
    rows, last = RefStream(HS, acc_slots), RefStream(AH, acc_slots, reduce="last")
    engine.refs = [rows, last]
    engine.session.enable_stream(HS)
    engine.session.enable_stream(AH, reduce="last")
    reqs = [Req(num=i, prompt=[1, 2, 3], gen=[4, 0]) for i in range(acc_slots)]
    engine.step([(r, 3) for r in reqs])
    for _ in range(2):
        engine.step([(r, 1) for r in reqs])
    check_rows(rows, decode_rows(*engine.fetch(HS)), rows.expected_rows([r.rid for r in reqs]))
    check_reduced(last, decode_rows(*engine.fetch(AH)), [r.rid for r in reqs])


@pytest.mark.parametrize("dtype", ["float32", None])
def test_a_mean_keeps_the_precision_of_the_stream_dtype(dtype):
    """The attention-head sites are float16. A mean asked for in float32 is the float32 mean of
    their rows, not that mean rounded to float16 on the way; without a dtype it is stored in
    the sites' float16."""
    engine = Engine()
    ref = RefStream(AH, 8, reduce="mean")
    engine.refs = [ref]
    engine.session.enable_stream(AH, reduce="mean", dtype=dtype)
    reqs = [Req(num=i, prompt=[1, 2, 3, 4, 0], gen=[1, 2, 3]) for i in range(3)]
    engine.step([(r, 5) for r in reqs])
    for _ in range(2):
        engine.step([(r, 1) for r in reqs])
    tensors, metas = engine.fetch(AH)
    rows = decode_rows(tensors, metas)
    assert {t.dtype for t in tensors.values()} == {torch.float32 if dtype else torch.float16}
    rounded = 0
    for layer, layer_rows in rows.items():
        for rid, _, _, values in layer_rows:
            r = ref.req[rid]
            want = act(r.num, ref.fed[rid], AH, layer).astype(np.float64).mean(axis=0)
            if dtype:
                np.testing.assert_allclose(values, want, rtol=1e-6, atol=1e-4)
            else:
                np.testing.assert_array_equal(values, want.astype(np.float16))
            rounded += int((want.astype(np.float16) != want).sum())
    assert rounded > 0  # float16 would have changed some of these means


def test_more_reduce_segments_than_ring_capacity():
    engine = Engine(capacity=2, acc_slots=4)
    ref = RefStream(HS, 4, reduce="mean")
    engine.refs = [ref]
    engine.session.enable_stream(HS, reduce="mean")
    reqs = [Req(num=i, prompt=[1, 2], gen=[]) for i in range(3)]
    engine.step([(r, 2) for r in reqs])
    check_reduced(ref, decode_rows(*engine.fetch(HS)), [r.rid for r in reqs])


def test_a_request_without_prompt_token_ids_does_not_break_the_step():
    engine = Engine()
    engine.session.enable_stream(HS)
    engine.session.add_request("emb-00000000", None)
    ok = Req(num=1, prompt=[1, 2], gen=[])
    engine.observe([(ok, 2)])
    engine.session.begin_step(StepBuffers(("emb-00000000", ok.rid), np.array([0, 2, 4], np.int32),
                                          np.zeros(2, np.int64), 4))
    engine.session.end_step()


# ---- 5. streams enabled mid-run and prefix-cache hits -----------------------------------------


def test_stream_enabled_while_requests_run():
    engine = Engine()
    a = Req(num=0, prompt=[1, 2, 3, 4, 0, 1], gen=[2, 3])  # mid-prefill at enable time
    b = Req(num=1, prompt=[3, 3], gen=[4, 4, 1])  # decoding at enable time
    engine.step([(a, 3), (b, 2)])
    engine.step([(b, 1)])
    full = RefStream(HS, 8)
    last_prompt = RefStream(AH, 8, select=SelectSpec.last_prompt_token().to_wire())
    engine.refs = [full, last_prompt]
    engine.session.enable_stream(HS)
    engine.session.enable_stream(AH, select=SelectSpec.last_prompt_token().to_wire())
    c = Req(num=2, prompt=[0, 1, 2], gen=[3])  # joins after the enable: complete
    engine.step([(a, 3), (b, 1), (c, 3)])
    while not all(r.done for r in (a, b, c)):
        engine.step([(r, 1) for r in (a, b, c) if not r.done])

    assert full.status == {a.rid: "elided", b.rid: "elided", c.rid: "ok"}
    with pytest.raises(RuntimeError, match="skip_reading_prefix_cache") as info:
        engine.session.fetch_stream(HS)
    assert a.rid in str(info.value) and b.rid in str(info.value)
    assert engine.session.stream_status(HS)["cache_elided_reqs"] == 2
    check_rows(full, decode_rows(*engine.fetch(HS, req_ids=[c.client])),
               full.expected_rows([c.rid]))

    # The last prompt token of a was still to come: not elided; b's was missed: elided.
    assert last_prompt.status == {a.rid: "ok", b.rid: "elided", c.rid: "ok"}
    with pytest.raises(RuntimeError, match="skip_reading_prefix_cache"):
        engine.session.fetch_stream(AH, req_ids=[b.rid])
    rows = decode_rows(*engine.fetch(AH, req_ids=[a.rid, c.rid]))
    check_rows(last_prompt, rows, {(a.rid, 5), (c.rid, 2)})


def test_a_streams_selection_is_decoded_once_for_every_request_it_opens():
    engine = Engine()
    wire = SelectSpec(prompt_window=(1, None)).to_wire()
    engine.session.enable_stream(AH, select=wire)
    stream = engine.session._streams[AH]
    assert stream.config.select == wire  # the wire form still goes to status and clients
    a, b = Req(num=0, prompt=[1, 2, 3], gen=[2]), Req(num=1, prompt=[3, 4], gen=[1])
    engine.step([(a, 3), (b, 2)])
    selects = [track.select for track in stream.tracks.values()]
    assert len(selects) == 2 and all(s is stream.config.select_spec for s in selects)
    assert stream.config.select_spec == SelectSpec.from_wire(wire)


def test_a_requests_own_selection_is_decoded_once_when_it_arrives(monkeypatch):
    engine = Engine()
    engine.session.enable_stream(AH)
    own = SelectSpec(prompt_positions=[0, -1]).to_wire()
    a = Req(num=0, prompt=[1, 2, 3], gen=[2], capture=own)
    decodes = []
    from_wire = SelectSpec.from_wire.__func__
    monkeypatch.setattr(SelectSpec, "from_wire",
                        classmethod(lambda cls, data: decodes.append(data) or from_wire(cls, data)))
    engine.step([(a, 3)])
    assert decodes == [own]  # at its arrival, not again when the stream opens its track
    track = engine.session._streams[AH].tracks[a.rid]
    assert track.select == SelectSpec.from_wire(own)


@pytest.mark.parametrize("select, elided", [
    (None, True),
    (SelectSpec.last_prompt_token(), False),
    (SelectSpec(prompt_window=(3, None)), False),
    (SelectSpec(prompt_window=(2, None)), True),
    (SelectSpec(generation="all"), False),
    (SelectSpec(prompt_tokens=[4]), False),  # token 4 first appears at position 4
    (SelectSpec(prompt_tokens=[2]), True),
    (SelectSpec(prompt="all", exclude_prompt_positions=[0, 1, 2]), False),
])
def test_prefix_cache_hit(select, elided):
    """The request's first step starts at position 3 (three prompt tokens came from the cache)."""
    engine = Engine()
    wire = None if select is None else select.to_wire()
    ref = RefStream(HS, 8, select=wire)
    engine.refs = [ref]
    engine.session.enable_stream(HS, select=wire)
    a = Req(num=0, prompt=[0, 1, 2, 3, 4, 0], gen=[1, 2], cache_hit=3)
    engine.step([(a, 2)])
    engine.step([(a, 1)])
    engine.step([(a, 1)])
    engine.step([(a, 1)])
    assert a.done and ref.status[a.rid] == ("elided" if elided else "ok")
    if elided:
        with pytest.raises(RuntimeError, match="skip_reading_prefix_cache"):
            engine.session.fetch_stream(HS)
    else:
        rows = decode_rows(*engine.fetch(HS))
        check_rows(ref, rows, ref.expected_rows([a.rid]))
        assert min(q for _, q, _, _ in rows[0]) >= 3


@pytest.mark.parametrize("reduce, elided", [("last", False), ("mean", True)])
def test_prefix_cache_hit_with_reductions(reduce, elided):
    engine = Engine()
    ref = RefStream(HS, 8, reduce=reduce)
    engine.refs = [ref]
    engine.session.enable_stream(HS, reduce=reduce)
    a = Req(num=0, prompt=[0, 1, 2, 3], gen=[1], cache_hit=2)
    engine.step([(a, 2)])
    engine.step([(a, 1)])
    if elided:
        with pytest.raises(RuntimeError, match="skip_reading_prefix_cache"):
            engine.session.fetch_stream(HS)
    else:
        check_reduced(ref, decode_rows(*engine.fetch(HS)), [a.rid])


@pytest.mark.parametrize("reduce, select, elided", [
    ("all", None, True),
    ("all", SelectSpec.last_prompt_token(), False),
    ("all", SelectSpec(prompt_window=(5, None)), False),
    ("all", SelectSpec(prompt_window=(4, None)), True),
    ("all", SelectSpec(prompt_positions=[0, 1]), False),
    ("last", None, False),
    ("mean", None, True),
])
def test_a_resume_past_the_requests_own_progress_loses_the_rows_between(reduce, select, elided):
    """Preempted after positions 0-1, the request resumes at position 5: another request cached
    more of the shared prompt meanwhile, so positions 2-4 are never computed for it."""
    engine = Engine()
    wire = None if select is None else select.to_wire()
    ref = RefStream(HS, 8, reduce=reduce, select=wire)
    engine.refs = [ref]
    engine.session.enable_stream(HS, reduce=reduce, select=wire)
    a = Req(num=0, prompt=[0, 1, 2, 3, 4, 5, 6], gen=[1, 2])
    engine.step([(a, 2)])
    engine.preempt(a, resume_at=5)
    while not a.done:
        engine.step([(a, min(a.known, a.total) - a.computed)])
    assert ref.status[a.rid] == ("elided" if elided else "ok")
    assert engine.session.stream_status(HS)["cache_elided_reqs"] == int(elided)
    if elided:
        with pytest.raises(RuntimeError, match="skip_reading_prefix_cache"):
            engine.session.fetch_stream(HS)
    elif reduce == "last":
        check_reduced(ref, decode_rows(*engine.fetch(HS)), [a.rid])
    else:
        rows = decode_rows(*engine.fetch(HS))
        check_rows(ref, rows, ref.expected_rows([a.rid]))


def test_generation_token_selection_is_applied_at_the_drain():
    """The host never knows decode tokens (all -1); the drain keeps rows by the device labels."""
    spec = SelectSpec(generation_tokens=[2, 3], exclude_generation_tokens=[3],
                      prompt_positions=[-1])
    engine = Engine()
    ref = RefStream(HS, 8, select=spec.to_wire())
    engine.refs = [ref]
    engine.session.enable_stream(HS, select=spec.to_wire())
    a = Req(num=0, prompt=[2, 2, 2], gen=[2, 3, 1, 2, 0, 2])
    b = Req(num=1, prompt=[0], gen=[3, 3, 2])
    engine.step([(a, 3), (b, 1)], pad=2)
    for _ in range(6):
        engine.step([(r, 1) for r in (b, a) if not r.done])
    rows = decode_rows(*engine.fetch(HS))
    check_rows(ref, rows, {(a.rid, 2), (a.rid, 3), (a.rid, 6), (a.rid, 8),
                           (b.rid, 0), (b.rid, 3)})


def test_per_request_selections_override_the_stream_selection():
    engine = Engine()
    stream_select = SelectSpec.last_prompt_token().to_wire()
    refs = {HS: RefStream(HS, 8, select=stream_select), AH: RefStream(AH, 8, layers=[1])}
    engine.refs = list(refs.values())
    engine.session.enable_stream(HS, select=stream_select)
    engine.session.enable_stream(AH, layers=[1])
    reqs = [
        Req(num=0, prompt=[1, 2, 3], gen=[1, 1]),  # stream selection
        Req(num=1, prompt=[1, 2, 3], gen=[1, 1], capture={"generation": "all"}),  # both streams
        Req(num=2, prompt=[4, 2, 3], gen=[1, 1],
            capture={AH: {"prompt_tokens": [4]}}),  # attention_heads only
        Req(num=3, prompt=[1, 2, 3, 4], gen=[0], capture={HS: SelectSpec(
            prompt_window=(0, 2)).to_wire()}),
    ]
    engine.step([(r, 3) for r in reqs])
    while not all(r.done for r in reqs):
        engine.step([(r, min(2, r.known - r.computed)) for r in reqs if not r.done])
    rids = [r.rid for r in reqs]
    check_rows(refs[HS], decode_rows(*engine.fetch(HS)), {
        (rids[0], 2), (rids[1], 3), (rids[1], 4), (rids[2], 2), (rids[3], 0), (rids[3], 1)})
    ah = refs[AH].expected_rows(rids)
    assert {(rids[1], 3), (rids[1], 4), (rids[2], 0)} <= ah and (rids[1], 0) not in ah
    check_rows(refs[AH], decode_rows(*engine.fetch(AH)), ah)


@dataclass(eq=False)
class ServerReq(Req):
    """A request that came through vLLM's OpenAI-compatible server: the selection is a JSON
    string in ``vllm_xargs`` (which carries only scalars), turned into SamplingParams by vLLM's
    own request model."""

    def sampling_params(self):
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest

        xargs = None if self.capture is None else {"capture": json.dumps(self.capture)}
        request = CompletionRequest(model="m", prompt="p", max_tokens=len(self.gen) + 1,
                                    vllm_xargs=xargs)
        return request.to_sampling_params(max_tokens=len(self.gen) + 1)


def test_selections_through_the_openai_servers_vllm_xargs():
    engine = Engine()
    ref = RefStream(HS, 8)
    engine.refs = [ref]
    engine.session.enable_stream(HS)
    reqs = [
        ServerReq(num=0, prompt=[1, 2, 3], gen=[1, 1]),  # no selection: the stream's (all rows)
        ServerReq(num=1, prompt=[1, 2, 3], gen=[1, 1], capture=SelectSpec.last_prompt_token().to_wire()),
        ServerReq(num=2, prompt=[4, 2, 3, 4], gen=[0], capture={HS: {"prompt_tokens": [4]}}),
    ]
    assert isinstance(reqs[1].sampling_params().extra_args["capture"], str)
    engine.step([(r, 3) for r in reqs])
    while not all(r.done for r in reqs):
        engine.step([(r, min(2, r.known - r.computed)) for r in reqs if not r.done])
    rids = [r.rid for r in reqs]
    want = ref.expected_rows(rids)
    assert {(rids[1], 2), (rids[2], 0), (rids[2], 3)} <= want
    assert (rids[1], 0) not in want and (rids[2], 1) not in want
    check_rows(ref, decode_rows(*engine.fetch(HS)), want)


def test_steps_are_stored_in_batches_and_in_order():
    """Many decode steps reach the store as a few appends per layer, rows still in step order."""
    engine = Engine()
    ref = RefStream(HS, 8)
    engine.refs = [ref]
    engine.session.enable_stream(HS)
    reqs = [Req(num=i, prompt=[1, 2, 3], gen=[1] * 40) for i in range(3)]
    engine.step([(r, 3) for r in reqs])
    while not all(r.done for r in reqs):
        engine.step([(r, 1) for r in reqs if not r.done])
    engine.session._wait_harvest()
    store = engine.session._streams[HS].store
    assert len(store.chunks[0]) < engine.step_no / 4
    rows = decode_rows(*engine.fetch(HS))
    check_rows(ref, rows, ref.expected_rows([r.rid for r in reqs]))
    for rid in (r.rid for r in reqs):
        positions = [p for r, p, _, _ in rows[0] if r == rid]
        assert positions == sorted(positions) == list(range(len(positions)))


def test_an_interpreter_exit_with_rows_in_flight_is_clean(tmp_path):
    """The harvest thread is ended at exit: a daemon thread still freeing tensors while the
    interpreter shuts down aborts the process (exit code 134), and a batch it stores after the
    interpreter has shut the store's copy threads down is stored all the same."""
    import subprocess
    import sys

    script = tmp_path / "exit_mid_capture.py"
    script.write_text(textwrap.dedent("""
        import types
        import numpy as np
        import torch
        from vllm_capture.capture_graph.state import CaptureGraphState
        from vllm_capture.selection import StepBuffers
        from vllm_capture.session.session import HARVEST_IDLE_S, CaptureSession

        state = CaptureGraphState(device=torch.device("cpu"), capacity=4096, acc_slots=64)
        for layer in range(8):
            state.add_site("hidden_states", layer, f"layers.{layer}", 2048, torch.bfloat16)
        state.allocate()
        state.set_input_ids(torch.zeros(4096, dtype=torch.int32))
        session = CaptureSession(state)
        session.enable_stream("hidden_states", layers={0, 3, 5, 7})
        ids = [f"r{i}" for i in range(64)]
        for rid in ids:
            session.add_request(rid, list(range(32)), types.SimpleNamespace(extra_args={}))
        for step in range(40):
            prefill = step == 0
            qsl = np.arange(65, dtype=np.int32) * (32 if prefill else 1)
            computed = np.full(64, 0 if prefill else 31 + step, dtype=np.int64)
            session.begin_step(StepBuffers(ids, qsl, computed, int(qsl[-1])))
            session.end_step()
        """))
    root = __import__("pathlib").Path(__file__).resolve().parent.parent
    for _ in range(3):
        done = subprocess.run([sys.executable, str(script)], cwd=root, capture_output=True,
                              text=True, timeout=120, env={**__import__("os").environ,
                                                           "PYTHONPATH": str(root)})
        assert done.returncode == 0, done.stderr[-2000:]
        assert "harvest failed" not in done.stderr, done.stderr[-2000:]


def test_unsupported_requests_fail_with_a_reason():
    engine = Engine()
    engine.session.enable_stream(HS)
    engine.session.enable_stream(AH, reduce="last")
    # A payload a client can send that json or numpy cannot take (nested past the recursion
    # limit, an int past int64) fails its request; it used to raise out of the step and kill
    # the engine.
    too_deep = Req(num=0, prompt=[1, 2], gen=[], capture="[" * 100_000)
    per_request = Req(num=1, prompt=[1, 2], gen=[], capture={"prompt": "all"})
    bad_wire = Req(num=2, prompt=[1, 2], gen=[], capture={"prompt": "most"})
    good = Req(num=3, prompt=[1, 2], gen=[])
    huge = Req(num=4, prompt=[1, 2], gen=[], capture=json.dumps({"prompt_positions": [10**30]}))
    engine.step([(too_deep, 2), (per_request, 2), (bad_wire, 2), (good, 2), (huge, 2)])
    with pytest.raises(RuntimeError, match="invalid extra_args"):
        engine.session.fetch_stream(HS, req_ids=[too_deep.rid])
    with pytest.raises(RuntimeError, match="invalid extra_args"):
        engine.session.fetch_stream(HS, req_ids=[bad_wire.rid])
    with pytest.raises(RuntimeError, match="prompt_positions.*out of range"):
        engine.session.fetch_stream(HS, req_ids=[huge.rid])
    with pytest.raises(RuntimeError, match="per-request selection cannot combine"):
        engine.session.fetch_stream(AH, req_ids=[per_request.rid])
    tensors, metas = engine.fetch(HS, req_ids=[per_request.rid, good.rid])
    assert sorted(set(metas[0].req_ids)) == sorted([per_request.rid, good.rid])
    assert engine.session.stream_status(HS)["failed_reqs"] == 3


# ---- 6. request index recycling ------------------------------------------------------------------


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rng=st.randoms(use_true_random=False))
def test_finished_request_indices_are_recycled_without_mislabelling(rng):
    engine = Engine()
    ref = RefStream(HS, 8)
    engine.refs = [ref]
    engine.session.enable_stream(HS)
    store = engine.session._streams[HS].store
    reqs = [Req(num=i, prompt=[rng.randrange(VOCAB) for _ in range(rng.randint(1, 3))],
                gen=[rng.randrange(VOCAB) for _ in range(rng.randint(0, 2))],
                client=rng.choice([f"c{i}", "same"]))
            for i in range(40)]
    queue, running, collected = list(reqs), [], {}
    finished_unfetched: list[Req] = []
    while queue or running:
        while queue and len(running) < 3:
            running.append(queue.pop(0))
        batch = []
        for r in running:
            start = r.computed if r.started else r.cache_hit
            batch.append((r, rng.randint(1, min(r.known, r.total) - start)))
        rng.shuffle(batch)
        engine.step(batch, pad=rng.randint(0, 2))
        for r in [r for r in running if r.done]:
            running.remove(r)
            finished_unfetched.append(r)
        choice = rng.random()
        if choice < 0.3:
            merge(collected, decode_rows(*engine.fetch(HS, clear=True)))
            finished_unfetched.clear()
        elif choice < 0.6 and finished_unfetched:
            pick = rng.sample(finished_unfetched, rng.randint(1, len(finished_unfetched)))
            ids = [r.rid for r in pick]
            rows = decode_rows(*engine.fetch(HS, clear=True, req_ids=ids))
            earlier = {(rid, q) for rid, q, _, _ in collected.get(0, [])}
            check_rows(ref, rows, ref.expected_rows(ids) - earlier)
            merge(collected, rows)
            for r in pick:
                finished_unfetched.remove(r)
    engine.observe([])
    merge(collected, decode_rows(*engine.fetch(HS, clear=True)))
    check_rows(ref, collected, ref.expected_rows([r.rid for r in reqs]))
    # Indices were recycled (at most 3 running plus finished-but-unfetched ones at a time).
    assert store._next_request_index < len(reqs)
    assert store.status()["requests"] == 0


def test_index_of_a_finished_request_waits_for_its_rows():
    engine = Engine()
    ref = RefStream(HS, 8)
    engine.refs = [ref]
    engine.session.enable_stream(HS)
    store = engine.session._streams[HS].store
    a = Req(num=0, prompt=[1, 2], gen=[])
    engine.step([(a, 2)])
    b = Req(num=1, prompt=[3], gen=[])
    engine.step([(b, 1)])  # a's finish arrives, its rows are still stored: no reuse
    assert store._req_index[a.rid] != store._req_index[b.rid]
    rows = decode_rows(*engine.fetch(HS, req_ids=[a.client]))  # frees a's index
    check_rows(ref, rows, {(a.rid, 0), (a.rid, 1)})
    c = Req(num=2, prompt=[4, 4], gen=[])
    engine.step([(c, 2)])  # b's finish arrives; c reuses a's index
    rows = decode_rows(*engine.fetch(HS))
    check_rows(ref, rows, {(b.rid, 0), (c.rid, 0), (c.rid, 1)})


# ---- 7. counters and the idle op -----------------------------------------------------------------


def test_eager_counters_and_idle_handle():
    engine = Engine()
    session, state = engine.session, engine.state
    rings = {id(s): (s.ring.clone(), s.ring_labels.clone(), s.acc.clone()) for s in
             state.sites.values()}
    a = Req(num=0, prompt=[1, 2, 3], gen=[4, 4])

    def untouched():
        for s in state.sites.values():
            ring, labels, acc = rings[id(s)]
            assert torch.equal(s.ring, ring) and torch.equal(s.ring_labels, labels)
            assert torch.equal(s.acc, acc)
            assert int(s.counter[L.SITE_EXECUTIONS]) == 0 and s.eager_executions == 0

    # No stream: the runner does not bracket the forward, and the op does nothing.
    engine.step([(a, 2)])
    untouched()
    status = session.stream_status(HS)
    assert status["enabled"] is False and status["hooked_layers"] == 3
    assert status["eager_capture_forwards"] == 0 and status["graph_replays"] == 0

    # attention_heads on: its sites run (a real step with eager launches counts once, whatever
    # stream launched).
    session.enable_stream(AH, layers=[1])
    engine.step([(a, 1)])
    assert engine.site(AH, 1).eager_executions == 1 and engine.site(AH, 0).eager_executions == 0
    assert session.stream_status(AH)["eager_capture_forwards"] == 1

    # hidden_states on (layers 0 and 2): one eager capture forward per real step.
    session.enable_stream(HS, layers=[0, 2])
    b = Req(num=1, prompt=[1, 2], gen=[])
    engine.step([(a, 1), (b, 1)])
    engine.step([(a, 1), (b, 1)])
    status = session.stream_status(HS)
    assert status["eager_capture_forwards"] == 3 and status["graph_replays"] == 0
    assert int(engine.site(HS, 0).counter[L.SITE_EXECUTIONS]) == 2
    assert engine.site(HS, 1).eager_executions == 0
    assert int(engine.site(HS, 1).counter[L.SITE_EXECUTIONS]) == 0
    assert status["graph_ready"] and status["layers_captured"] == 2

    # Forwards outside a real step (dummy, profile runs) capture and count nothing.
    before = [s.ring.clone() for s in state.sites.values()]
    engine.forward([], 4)
    assert all(torch.equal(s.ring, r) for s, r in zip(state.sites.values(), before))
    assert session.stream_status(HS)["eager_capture_forwards"] == 3

    # Disabled again: back to nothing.
    session.disable_stream(HS)
    session.disable_stream(AH)
    assert not session.any_stream_enabled()
    counts = [int(s.counter[L.SITE_EXECUTIONS]) for s in state.sites.values()]
    engine.step([(Req(num=2, prompt=[1, 2], gen=[]), 2)])
    assert [int(s.counter[L.SITE_EXECUTIONS]) for s in state.sites.values()] == counts
    assert session.fetch_stream(HS) == {}


def test_a_last_stream_of_hidden_states_launches_the_kernel_at_its_first_layer_only():
    """The layers store their last rows themselves; the kernel acts at the stream's first layer
    only, for the labels and counts every layer's rows are read with. A mean needs it at every
    layer, and so does a stream of another component."""
    engine = Engine(acc_slots=2)
    ref = RefStream(HS, 2, reduce="last", layers=[1, 2])
    engine.refs = [ref]
    engine.session.enable_stream(HS, reduce="last", layers=[1, 2])
    engine.session.enable_stream(AH, reduce="last")
    a = Req(num=0, prompt=[1, 2, 3], gen=[4, 4])
    engine.step([(a, 3)])
    engine.step([(a, 1)])
    assert [(s.launches, s.eager_executions) for s in map(engine.site, [HS] * 3, (0, 1, 2))] == [
        (False, 0), (True, 2), (False, 0)]
    assert [s.eager_executions for s in map(engine.site, [AH] * 2, (0, 1))] == [2, 2]
    engine.step([(a, 1)])
    assert a.done
    engine.step([])  # its finish reaches the worker
    check_reduced(ref, decode_rows(*engine.fetch(HS)), [a.rid])

    engine.session.enable_stream(HS, reduce="mean", layers=[1, 2])
    assert [s.launches for s in map(engine.site, [HS] * 3, (0, 1, 2))] == [False, True, True]
    assert not engine.state.last_row_plans[HS].active


def test_an_eager_step_that_selects_no_row_launches_nothing():
    """A clause that keeps the last prompt row: the prefill step launches on every enabled site,
    the decode steps after it select nothing and launch nothing, and the rows are the same."""
    engine = Engine()
    ref = RefStream(HS, 8, select=SelectSpec(prompt_positions=(-1,)).to_wire())
    engine.refs = [ref]
    engine.session.enable_stream(HS, select=SelectSpec(prompt_positions=(-1,)).to_wire())
    a = Req(num=0, prompt=[1, 2, 3], gen=[4, 4, 4])
    engine.step([(a, 3)])
    sites = [engine.site(HS, layer) for layer in (0, 1, 2)]
    assert [s.eager_executions for s in sites] == [1, 1, 1]
    for _ in range(3):
        engine.step([(a, 1)])
    assert [s.eager_executions for s in sites] == [1, 1, 1]
    assert [int(s.counter[L.SITE_EXECUTIONS]) for s in sites] == [1, 1, 1]
    assert engine.session.stream_status(HS)["eager_capture_forwards"] == 1
    check_rows(ref, decode_rows(*engine.fetch(HS)), {(a.rid, 2)})


def _prefilled_pair(reduce: str, generated: int):
    """An engine with one ``HS`` stream and two requests of two-token prompts, both prefilled."""
    engine = Engine(acc_slots=3)
    ref = RefStream(HS, 3, reduce=reduce)
    engine.refs = [ref]
    engine.session.enable_stream(HS, reduce=reduce)
    a = Req(num=0, prompt=[1, 2], gen=[3, 1, 2, 4, 5][:generated])
    b = Req(num=1, prompt=[4, 4], gen=[1, 2, 3, 0, 1][:generated])
    engine.step([(a, 2), (b, 2)])
    return engine, ref, a, b


def _check_fetched(engine, ref, reduce: str, reqs) -> None:
    engine.step([])
    rows = decode_rows(*engine.fetch(HS))
    if reduce == "all":
        check_rows(ref, rows, ref.expected_rows([r.rid for r in reqs]))
    else:
        check_reduced(ref, rows, [r.rid for r in reqs])


@pytest.mark.parametrize("reduce", ["last", "mean", "all"])
def test_a_step_repeating_the_last_plan_uploads_nothing(reduce):
    """At steady decode a plan repeats step after step: the device keeps it, and only a changed
    plan is copied. A reduction's plan is the same; a row stream's moves on in the ring and in
    position, which the device plan's step count says (one value set, no copy). The rows still
    come out right: the fake model reads the plan from the device buffer."""
    engine, ref, a, b = _prefilled_pair(reduce, generated=4)
    uploads, moved = [engine.state.plan_uploads], [engine.state.plan_steps]
    timers = [engine.session.stream_status(HS)["host_timers"]]
    while not a.done:
        engine.step([(a, 1), (b, 1)])
        uploads.append(engine.state.plan_uploads)
        moved.append(engine.state.plan_steps)
        timers.append(engine.session.stream_status(HS)["host_timers"])
    assert np.diff(uploads).tolist() == [1, 0, 0, 0]
    assert np.diff(moved).tolist() == ([0, 1, 1, 1] if reduce == "all" else [0, 0, 0, 0])
    # The timers tell the steps that planned nothing apart: begin_repeat is their begin_step.
    assert [t["repeat_steps"] for t in timers] == [0, 0, 1, 2, 3]
    assert [t["steps"] for t in timers] == [1, 2, 3, 4, 5]
    grew = np.diff([t["begin_repeat_ms"] for t in timers]) > 0
    assert grew.tolist() == [False, True, True, True]
    assert 0 < timers[-1]["begin_repeat_ms"] < timers[-1]["begin_step_ms"]
    if reduce == "all":
        assert int(engine.state.streams[HS].meta[L.META_STEP]) == 3
    _check_fetched(engine, ref, reduce, (a, b))


def test_a_plan_written_after_repeats_is_copied_even_if_it_equals_the_devices_first():
    """After repeated steps the device's plan differs from the one copied (its step count moved
    on), so a plan equal to that first one, back at the ring's start, is still copied."""
    state = CaptureGraphState(device=torch.device("cpu"), capacity=4, ring_slots=2)
    state.add_site(HS, 0, "model.layers.0", 8, torch.float32)
    state.allocate()
    buf = state.streams[HS]
    rows, req = np.arange(4, dtype=np.int32), np.arange(4, dtype=np.int32)
    positions = np.full(4, 7, dtype=np.int32)
    state.upload_rows(HS, rows, req, positions)
    state.upload_rows(HS, rows, req, positions + 1, repeat=True)
    assert (state.plan_uploads, state.plan_steps, int(buf.meta[L.META_STEP])) == (1, 1, 1)
    buf.pending_start = buf.offset  # drained: the next step may start the ring again
    state.upload_rows(HS, rows, req, positions)  # the first plan's image, at row 0 again
    assert state.plan_uploads == 2
    assert int(buf.meta[L.META_STEP]) == 0 and int(buf.meta[L.META_OFFSET]) == 0


@pytest.mark.parametrize("reduce", ["all", "mean"])
def test_a_request_preempted_after_repeated_steps_is_not_captured_twice(reduce):
    """Repeated decode steps move the requests' high-water marks on inside the repeat only; a
    request preempted after them and recomputed from its start must still find its mark, so that
    no recomputed position is captured (or reduced into its mean) a second time."""
    engine, ref, a, b = _prefilled_pair(reduce, generated=5)
    for _ in range(3):
        engine.step([(a, 1), (b, 1)])
    uploads = engine.state.plan_uploads
    engine.step([(a, 1), (b, 1)])
    assert engine.state.plan_uploads == uploads  # a repeat: nothing planned, nothing copied
    engine.preempt(a)
    engine.step([(b, 1), (a, a.known)])
    while not a.done or not b.done:
        engine.step([(r, 1) for r in (a, b) if not r.done])
    _check_fetched(engine, ref, reduce, (a, b))


class _StepV2Runner:
    """vLLM's V2 runner as wrap_runner sees it, running the Engine's steps: ``execute_model``
    prepares the step's InputBatch (its query_start_loc padded past the requests, as vLLM's
    buffer is) and runs the forward."""

    def __init__(self, engine):
        self.engine = engine
        self.input_buffers = types.SimpleNamespace(input_ids=engine.input_ids)

    def prepare_inputs(self, scheduler_output):
        step = scheduler_output.step
        qsl = step.query_start_loc
        return types.SimpleNamespace(
            req_ids=list(step.req_ids), num_computed_tokens_np=step.num_computed,
            query_start_loc_np=np.concatenate([qsl, np.full(3, qsl[-1], qsl.dtype)]),
            num_tokens_after_padding=step.num_rows_padded)

    def execute_model(self, scheduler_output, dummy_run=False):
        batch = self.prepare_inputs(scheduler_output)
        self.engine.forward(scheduler_output.entries, batch.num_tokens_after_padding)


class _StepV1Runner:
    """vLLM's V1 (and CPU) runner as wrap_runner sees it: persistent int32 buffers longer than
    the step's requests, and ``_model_forward`` called with the step's padded input ids."""

    def __init__(self, engine):
        self.engine = engine
        self.input_ids = types.SimpleNamespace(gpu=engine.input_ids)
        self.input_batch = types.SimpleNamespace(req_ids=[], num_reqs=0,
                                                 num_computed_tokens_cpu=None)
        self.query_start_loc = types.SimpleNamespace(np=None)
        self._entries = None

    def execute_model(self, scheduler_output):
        step = scheduler_output.step
        batch = self.input_batch
        batch.req_ids = list(step.req_ids) + ["stale-0123abcd"]  # a slot past num_reqs
        batch.num_reqs = len(step.req_ids)
        batch.num_computed_tokens_cpu = np.concatenate([step.num_computed, [99]]).astype(np.int32)
        self.query_start_loc.np = np.concatenate([step.query_start_loc, [0, 0]]).astype(np.int32)
        self._entries = scheduler_output.entries
        self._model_forward(input_ids=torch.zeros(step.num_rows_padded, dtype=torch.int32))

    def _model_forward(self, input_ids=None, **kwargs):
        self.engine.forward(self._entries, input_ids.shape[0])


@pytest.mark.parametrize("runner", [_StepV1Runner, _StepV2Runner])
@pytest.mark.parametrize("reduce", ["all", "last", "mean"])
def test_steps_reach_the_session_through_the_runner_wrappers(runner, reduce):
    """The runner wrappers, not the test, tell the session of each step: its scheduler output
    (new, resumed and finished requests, and a warm-up request vLLM runs through real steps),
    the step's buffers and the forward's end. Chunked prefill with padding, decode, a
    preemption; the rows are the reference's."""
    engine = Engine(acc_slots=4, runner=runner)
    ref = RefStream(HS, 8, reduce=reduce) if reduce != "all" else RefStream(HS, 8)
    engine.refs = [ref]
    engine.session.enable_stream(HS, reduce=reduce)
    a = Req(num=0, prompt=[1, 2, 3, 4, 5], gen=[6, 7, 8, 9])
    b = Req(num=1, prompt=[2, 3], gen=[4, 5, 6, 7, 1])
    engine.step([(a, 3), ("_v2_mixed_warmup_0", 2), (b, 2)], pad=3)
    engine.step([(b, 1), (a, 2)])
    engine.step([(a, 1), (b, 1)])
    engine.preempt(b)
    engine.step([(a, 1), (b, b.known)], pad=1)
    while not a.done or not b.done:
        engine.step([(r, 1) for r in (b, a) if not r.done])
    steps = engine.step_no
    _check_fetched(engine, ref, reduce, (a, b))
    status = engine.session.stream_status(HS)
    # Each step's eager launches are counted when the wrapper ends it (the last step is empty).
    assert status["failed_reqs"] == 0 and status["eager_capture_forwards"] == steps


class _FakeV2Runner:
    """What wrap_runner sees of vLLM's V2 runner; records the device plan's mode at each call."""

    def __init__(self, engine):
        self.input_buffers = types.SimpleNamespace(input_ids=engine.input_ids)
        self.mode = lambda: int(engine.state.streams[HS].meta[L.META_MODE])
        self.seen = []

    def prepare_inputs(self, scheduler_output):
        raise AssertionError("not called here")

    def execute_model(self, scheduler_output, dummy_run=False):
        self.seen.append(("execute_model", dummy_run, self.mode()))

    def _dummy_run(self, num_tokens, **kwargs):
        self.seen.append(("_dummy_run", num_tokens, self.mode()))

    def capture_model(self):
        self.seen.append(("capture_model", None, self.mode()))


class _FakeV1Runner(_FakeV2Runner):
    def __init__(self, engine):
        super().__init__(engine)
        del self.input_buffers
        self.input_batch = None
        self.input_ids = types.SimpleNamespace(gpu=engine.input_ids)

    def _model_forward(self, **kwargs):
        raise AssertionError("not called here")


@pytest.mark.parametrize("runner_class", [_FakeV1Runner, _FakeV2Runner])
def test_runners_switch_the_device_plan_off_before_forwards_that_are_not_steps(runner_class):
    """A step leaves its plan on the device (the next one may repeat it), so vLLM's dummy,
    profile and capture runs, whose replays would read it, find it switched off first."""
    from vllm_capture.engine.runners import wrap_runner

    engine = Engine(acc_slots=3)
    runner = runner_class(engine)
    assert wrap_runner(runner, engine.session) is engine.input_ids
    engine.session.enable_stream(HS, reduce="last")
    a = Req(num=0, prompt=[1, 2], gen=[3, 1, 2, 4, 0, 1])
    calls = [lambda: runner._dummy_run(4), runner.capture_model]
    if runner_class is _FakeV2Runner:
        calls.append(lambda: runner.execute_model(None, dummy_run=True))
    for call in calls:
        engine.step([(a, 1 if a.computed else 2)])
        assert runner.mode() == L.MODE_LAST  # left on by the step
        call()
        assert runner.seen[-1][2] == L.MODE_OFF
    assert len(runner.seen) == len(calls)
    engine.step([(a, 1)])  # the next step uploads its plan again
    assert runner.mode() == L.MODE_LAST


def test_kernels_compile_in_a_process_and_load_before_the_first_launch(monkeypatch, caplog):
    """On CUDA the kernel variants start compiling in a child process at set_input_ids (only
    dtypes and the device's target); the first launch (graph capture, or an eager step) waits
    for the child, then loads each variant from the child's Triton cache; a failed child is
    warned about and the loads compile the variants themselves."""
    import vllm_capture.capture_graph.state as state_module
    from vllm_capture.capture_graph.state import Site

    calls = []

    class FakeChild:
        def __init__(self, failure):
            self.failure, self.seconds, self.in_cache = failure, None, False

        def wait(self):
            calls.append(("wait",))
            self.seconds = 1.5
            return self.failure

        @contextlib.contextmanager
        def cache(self):
            self.in_cache = True
            yield
            self.in_cache = False

    children = []

    def start(target, dtypes, ids_dtypes):
        calls.append(("start", target, list(dtypes), tuple(ids_dtypes)))
        children.append(FakeChild("exit status 1: ptxas failed" if "boom" in dtypes else None))
        return children[-1]

    def warmup(device, dtypes, *, ids_dtypes):
        calls.append(("load", list(dtypes), ids_dtypes, children[-1].in_cache))
        return len(dtypes)

    monkeypatch.setattr(state_module.compile_process, "current_target", lambda device: "sm90")
    monkeypatch.setattr(state_module.compile_process, "start", start)
    monkeypatch.setattr(state_module, "warmup", warmup)

    def cuda_state(*dtypes):
        state = CaptureGraphState(device=torch.device("cuda"), capacity=4)
        for i, dtype in enumerate(dtypes):
            state.sites[i] = Site(HS, i, f"l{i}", 5, dtype, torch.zeros(2, dtype=torch.int32))
        return state

    state = cuda_state(torch.bfloat16, torch.float32, torch.bfloat16)
    state.set_input_ids(torch.zeros(4, dtype=torch.int64))
    assert calls == [("start", "sm90", [torch.bfloat16, torch.float32], (torch.int64,))]
    state.await_kernels()
    assert calls[1:] == [("wait",), ("load", [torch.bfloat16], (torch.int64,), True),
                         ("load", [torch.float32], (torch.int64,), True)]
    assert state.startup_ms["kernel_compile"] == 1500.0 and "kernel_wait" in state.startup_ms
    state.await_kernels()  # once only
    assert len(calls) == 4
    assert not caplog.records

    state = cuda_state("boom")
    state.set_input_ids(torch.zeros(4, dtype=torch.int32))
    with caplog.at_level("WARNING", logger="vllm_capture"):
        state.await_kernels()
    assert "ptxas failed" in caplog.text and "compiling them in the engine" in caplog.text
    assert calls[-1] == ("load", ["boom"], (torch.int32,), True)  # the load compiles


def test_kernels_of_a_marked_cache_load_without_a_child(monkeypatch, tmp_path):
    """Where Triton's cache holds a child's marker (``compile_process.start`` starts none), the
    loads still read that cache, and the compile reads 0 ms."""
    import triton

    import vllm_capture.capture_graph.state as state_module
    from vllm_capture.capture_graph.state import Site
    from vllm_capture.kernels.compile_process import CompileProcess

    loads = []
    monkeypatch.setattr(state_module.compile_process, "current_target", lambda device: "sm90")
    monkeypatch.setattr(state_module.compile_process, "start",
                        lambda target, dtypes, ids_dtypes: CompileProcess(None, str(tmp_path)))
    monkeypatch.setattr(state_module, "warmup", lambda device, dtypes, *, ids_dtypes:
                        loads.append((list(dtypes), triton.knobs.cache.dir)))
    state = CaptureGraphState(device=torch.device("cuda"), capacity=4)
    state.sites[0] = Site(HS, 0, "l0", 5, torch.bfloat16, torch.zeros(2, dtype=torch.int32))
    state.set_input_ids(torch.zeros(4, dtype=torch.int64))
    state.await_kernels()
    assert loads == [([torch.bfloat16], str(tmp_path))]
    assert state.startup_ms["kernel_compile"] == 0.0


@pytest.mark.parametrize("runner_class", [_FakeV1Runner, _FakeV2Runner])
def test_runners_wait_for_the_kernels_before_graph_capture_only(runner_class, monkeypatch):
    """vLLM's profile run compiles the model while the kernels compile; graph capture, which
    records their launches, waits for them."""
    from vllm_capture.engine.runners import wrap_runner

    engine = Engine(acc_slots=3)
    runner = runner_class(engine)
    wrap_runner(runner, engine.session)
    waits = []
    monkeypatch.setattr(engine.state, "await_kernels", lambda: waits.append(len(runner.seen)))
    runner._dummy_run(4)
    assert waits == []
    runner.capture_model()
    assert waits == [1] and runner.seen[-1][0] == "capture_model"


def test_int64_input_ids_and_ring_wraps():
    """vLLM's persistent input_ids may be int64; steps that run past the ring's end wrap to its
    start after the rows there were drained, several steps per drain."""
    engine = Engine(capacity=3, ids_dtype=torch.int64, ring_slots=3)
    ref = RefStream(HS, 8)
    engine.refs = [ref]
    engine.session.enable_stream(HS)
    uploads, drains, waits = [], [], []  # steps per drain
    upload, drain, wait = engine.state.upload_rows, engine.state.drain, engine.state._wait_for_copies
    engine.state.upload_rows = lambda *args, **kw: uploads.append(1) or upload(*args, **kw)
    engine.state.drain = lambda *args: drains.append(len(uploads)) or uploads.clear() or drain(*args)
    engine.state._wait_for_copies = lambda buf, start, end: waits.append(
        [(first, stop) for first, stop, _ in buf.copies if first < end and start < stop]) or wait(
        buf, start, end)
    a = Req(num=0, prompt=[4, 3, 2, 1], gen=[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0])
    engine.step([(a, 2)], pad=1)
    while not a.done:
        engine.step([(a, min(2, a.known - a.computed))], pad=1)
    check_rows(ref, decode_rows(*engine.fetch(HS)), ref.expected_rows([a.rid]))
    # 2 + 2 + 1 * 12 rows into a 9-row ring, drained at 5 rows (half of it) or before a wrap;
    # steps back at the ring's start wait for the drains that read the rows they overwrite.
    assert max(drains) >= 2 and any(waits)


@pytest.mark.parametrize("drain_bytes,steps_per_drain", [(1, 1), (10**12, None)])
def test_drains_are_due_by_bytes_or_half_the_ring(drain_bytes, steps_per_drain):
    """Decode steps of 2 rows: drained every step when any byte is due, else when half the
    ring (2 x 96 rows) is pending, i.e. every 48 steps, and what is left at the fetch."""
    engine = Engine()
    engine.state.drain_bytes = drain_bytes
    ref = RefStream(HS, 8)
    engine.refs = [ref]
    engine.session.enable_stream(HS)
    uploads, drains = [], []
    upload, drain = engine.state.upload_rows, engine.state.drain
    engine.state.upload_rows = lambda *args, **kw: uploads.append(1) or upload(*args, **kw)
    engine.state.drain = lambda *args: drains.append(len(uploads)) or uploads.clear() or drain(*args)
    reqs = [Req(num=i, prompt=[1], gen=[2] * 60) for i in range(2)]
    while not all(r.done for r in reqs):
        engine.step([(r, 1) for r in reqs if not r.done])
    check_rows(ref, decode_rows(*engine.fetch(HS)), ref.expected_rows([r.rid for r in reqs]))
    if steps_per_drain == 1:
        assert drains == [1] * 61
    else:
        assert drains[0] == MAX_ROWS // 2 and sum(drains) == 61


def _spy_drains(engine) -> list:
    """Record each drain's order and the host rows it returned."""
    seen, drain = [], engine.state.drain

    def spy(component, order=None):
        drained = drain(component, order)
        seen.append((None if order is None else order.tolist(), drained))
        return drained

    engine.state.drain = spy
    return seen


@pytest.mark.parametrize("batch_order", ["registration", "reversed"])
def test_drained_rows_arrive_in_the_stores_order_and_are_kept_as_they_are(batch_order):
    """Several decode steps drained at once leave the device grouped by request, in registration
    order, whatever order the batch runs them in; the store keeps the drained host tensors
    instead of copying them, and the rows are right."""
    engine = Engine()
    engine.state.drain_bytes = 10**12  # one drain, at the fetch
    ref = RefStream(HS, 8)
    engine.refs = [ref]
    engine.session.enable_stream(HS)
    seen = _spy_drains(engine)
    a, b = Req(num=0, prompt=[1], gen=[2] * 4), Req(num=1, prompt=[1], gen=[3] * 4)
    engine.step([(a, 1), (b, 1)])  # registered a, then b
    while not (a.done and b.done):
        pairs = [(a, 1), (b, 1)] if batch_order == "registration" else [(b, 1), (a, 1)]
        engine.step([(r, n) for r, n in pairs if not r.done])
    st = engine.session._streams[HS]
    engine.session._drain(st)
    engine.session._await_harvest()
    [(order, drained)] = seen
    # Planned rows: a0 b0, then a1 b1, a2 b2, ... or b1 a1, b2 a2, ...: a's rows first in the
    # drain, each request's in step order.
    assert order == ([0, 2, 4, 6, 8, 1, 3, 5, 7, 9] if batch_order == "registration"
                     else [0, 3, 5, 7, 9, 1, 2, 4, 6, 8])
    labels = next(iter(drained.layers.values()))[1]
    assert labels[:, 1].tolist() == [0, 1, 2, 3, 4] * 2  # positions, a's rows then b's
    for layer, (host_rows, _) in drained.layers.items():
        [chunk] = st.store.chunks[layer].values()
        assert chunk.tensor.data_ptr() == host_rows.data_ptr()  # adopted, not copied
    check_rows(ref, decode_rows(*engine.fetch(HS)), ref.expected_rows([a.rid, b.rid]))


def test_a_drain_past_gather_bytes_leaves_in_ring_order_and_the_store_orders_it():
    """Past ``gather_bytes`` a drain takes no device memory: each site's rows are copied as the
    ring holds them, and the store puts them in request order on the host. Same rows, same
    budget cut, as a gathered drain."""
    def run(gather_bytes):
        engine = Engine()
        engine.state.drain_bytes = 10**12  # one drain, at the fetch
        engine.state.gather_bytes = gather_bytes
        ref = RefStream(HS, 8)
        engine.refs = [ref]
        engine.session.enable_stream(HS, budget_rows=9)
        seen = _spy_drains(engine)
        a, b = Req(num=0, prompt=[1], gen=[2] * 4), Req(num=1, prompt=[1], gen=[3] * 4)
        engine.step([(a, 1), (b, 1)])  # registered a, then b; then b runs first
        while not (a.done and b.done):
            engine.step([(r, 1) for r in (b, a) if not r.done])
        # The budget keeps the 9 rows planned first: all but a's last.
        check_rows(ref, decode_rows(*engine.fetch(HS)),
                   ref.expected_rows([a.rid, b.rid]) - {(a.rid, 4)})
        assert engine.session.stream_status(HS)["tokens_dropped"] == 1
        [(order, drained)] = seen
        return order, next(iter(drained.layers.values()))[1]

    order, _ = run(10**12)
    assert order is not None  # put in the store's order on the device
    order, labels = run(0)
    assert order is None
    assert labels[:, 1].tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]  # ring order: the batch's


def test_a_budget_keeps_the_earliest_rows_of_a_reordered_drain():
    """Rows past the budget are the latest planned, even when the drain put them in another
    order: b runs first in every step but is registered second."""
    engine = Engine()
    engine.state.drain_bytes = 10**12
    engine.session.enable_stream(HS, budget_rows=5)
    seen = _spy_drains(engine)
    a, b = Req(num=0, prompt=[1], gen=[2] * 3), Req(num=1, prompt=[1], gen=[3] * 3)
    engine.step([(a, 1), (b, 1)])
    while not (a.done and b.done):
        engine.step([(r, 1) for r in (b, a) if not r.done])
    rows = decode_rows(*engine.fetch(HS))
    assert seen[0][0] is not None  # the drain was reordered
    # Planned: a0 b0, b1 a1, b2 a2, b3 a3: the first five are kept, a's and b's rows grouped.
    for layer_rows in rows.values():
        assert [(rid, q) for rid, q, _, _ in layer_rows] == [
            (a.rid, 0), (a.rid, 1), (b.rid, 0), (b.rid, 1), (b.rid, 2)]
    assert engine.session.stream_status(HS)["tokens_dropped"] == 3


def test_a_finished_request_keeps_its_index_until_its_rows_leave_the_ring():
    """Rows still in the device ring when their request finishes: the finish marker waits for the
    drain that carries them, even if the harvest thread stores everything it holds meanwhile."""
    engine = Engine()
    ref = RefStream(HS, 8)
    engine.refs = [ref]
    engine.session.enable_stream(HS)
    a = Req(num=0, prompt=[1, 2], gen=[3])
    engine.step([(a, 2)])
    engine.step([(a, 1)])
    assert engine.state.streams[HS].pending_rows == 3
    b = Req(num=1, prompt=[3], gen=[])
    engine.step([(b, 1)])  # a's finish arrives while its rows are in the ring
    time.sleep(5 * HARVEST_IDLE_S)  # the harvest thread stores what it holds
    c = Req(num=2, prompt=[4], gen=[])
    engine.step([(c, 1)])  # b's finish: a new index must not take a's
    rows = decode_rows(*engine.fetch(HS))
    check_rows(ref, rows, ref.expected_rows([a.rid, b.rid, c.rid]))


# ---- failures that must not leave a fetch silently partial -------------------------------------


def _failing_appends(monkeypatch, store, times=1):
    """``store``'s next ``times`` appends raise (a host out of memory, say), on whichever thread."""
    real, left = StreamStore.append_layers, [times]

    def append_layers(self, *args, **kwargs):
        if self is store and left[0] > 0:
            left[0] -= 1
            raise MemoryError("host out of memory while storing a drain")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(StreamStore, "append_layers", append_layers)


def test_a_failed_harvest_makes_every_fetch_of_its_stream_raise_until_cleared(monkeypatch):
    engine = Engine()
    engine.session.enable_stream(HS)
    engine.session.enable_stream(AH)
    a = Req(num=0, prompt=[1, 2, 3, 4], gen=[1, 2])
    engine.step([(a, 4)])
    engine.session._wait_harvest()  # step 0's rows are stored
    _failing_appends(monkeypatch, engine.session._streams[HS].store)
    engine.step([(a, 1)])  # position 4's rows fail to store, on the harvest thread
    with pytest.raises(RuntimeError, match="harvest failed"):
        engine.session.stream_status(AH)  # another stream's call is the first to hear of it
    engine.step([(a, 1)])
    engine.step([])
    status = engine.session.stream_status(HS)
    assert status["meta_complete"] is False and "MemoryError" in status["rows_lost"]
    for _ in range(2):  # not once: every fetch, until the stream is cleared
        with pytest.raises(RuntimeError, match="lost before they were stored"):
            engine.session.fetch_stream(HS)
    # The failed batch held the other stream's rows of that step too: whether they were stored
    # is not known either.
    assert engine.session.stream_status(AH)["meta_complete"] is False
    for stream in (HS, AH):
        engine.session.clear_stream(stream)
        assert engine.session.stream_status(stream)["rows_lost"] is None
        assert engine.session.fetch_stream(stream) == {}


def test_reductions_a_failed_fetch_read_are_kept_for_the_next(monkeypatch):
    """The harvest error reaches a fetch of another stream after that fetch read its closed
    reductions (and freed their slots): they wait for the next fetch instead of vanishing."""
    engine = Engine(acc_slots=4)
    ref = RefStream(HS, 4, reduce="last")
    engine.refs = [ref]
    engine.session.enable_stream(HS, reduce="last")
    engine.session.enable_stream(AH)
    a = Req(num=0, prompt=[1, 2, 3], gen=[4])
    _failing_appends(monkeypatch, engine.session._streams[AH].store, times=10)
    engine.step([(a, 3)])
    engine.step([(a, 1)])
    engine.step([])  # a finished: its reduction waits in its slot for the fetch
    with pytest.raises(RuntimeError, match="harvest failed"):
        engine.session.fetch_stream(HS)
    check_reduced(ref, decode_rows(*engine.fetch(HS)), [a.rid])


def test_reductions_a_fetch_fails_to_store_mark_the_stream_lost(monkeypatch):
    """A fetch stores the reductions it read on its own thread: if that fails, the slots are
    already freed, so the stream says its rows were lost and every fetch raises until cleared,
    rather than the next fetch returning nothing."""
    engine = Engine(acc_slots=4)
    engine.session.enable_stream(HS, reduce="last")
    a = Req(num=0, prompt=[1, 2, 3], gen=[4])
    engine.step([(a, 3)])
    engine.step([(a, 1)])
    engine.step([])  # a finished: its reduction waits in its slot for the fetch
    _failing_appends(monkeypatch, engine.session._streams[HS].store)
    with pytest.raises(MemoryError):
        engine.session.fetch_stream(HS)
    status = engine.session.stream_status(HS)
    assert status["meta_complete"] is False and "reductions a fetch read" in status["rows_lost"]
    with pytest.raises(RuntimeError, match="lost before they were stored"):
        engine.session.fetch_stream(HS)


def test_a_reply_that_fails_to_build_leaves_every_row_for_the_next_fetch():
    """``build`` (the worker's reply: its shared-memory file, say) runs before a clear removes
    anything, so a reply that fails leaves the rows, not an empty next fetch."""
    engine = Engine()
    ref = RefStream(HS, 8)
    engine.refs = [ref]
    engine.session.enable_stream(HS)
    a = Req(num=0, prompt=[1, 2, 3], gen=[4, 5])
    engine.step([(a, 3)])
    engine.step([(a, 1)])
    engine.step([])

    def build(result):
        assert result  # the rows were there to build from
        raise MemoryError("no room for the reply file")

    with pytest.raises(MemoryError):
        engine.session.fetch_stream(HS, clear=True, build=build)
    assert engine.session.stream_status(HS)["meta_complete"] is True
    check_rows(ref, decode_rows(*engine.fetch(HS)), ref.expected_rows([a.rid]))


@pytest.mark.parametrize("enabled", [False, True])
def test_the_workers_fetch_reply_is_one_the_client_joins(enabled):
    """The worker's fetch RPC on this session, with a stream off (an empty reply, not a bare
    dict) and on, through shared memory: ``join_shards`` takes the reply as from a real engine."""
    from vllm_capture import api
    from vllm_capture.engine.worker_ext import CaptureWorkerExtension
    from vllm_capture.session import shm

    engine = Engine()
    ref = RefStream(HS, 8)
    engine.refs = [ref]
    a = Req(num=0, prompt=[1, 2, 3], gen=[4, 5])
    if enabled:
        engine.session.enable_stream(HS)
    engine.step([(a, 3)])
    engine.step([(a, 1)])
    engine.step([])
    worker = CaptureWorkerExtension.__new__(CaptureWorkerExtension)
    worker._capture_session = lambda: engine.session
    reply = worker.fetch_captured(HS, shm_probe=shm.client_probe())
    tensors, meta, _ = api.join_shards(HS, shm.read_replies([reply]))
    if enabled:
        check_rows(ref, decode_rows(tensors, meta), ref.expected_rows([a.rid]))
    else:
        assert tensors == {}


def test_a_drain_that_fails_marks_its_stream_lost(monkeypatch):
    """The rows of a failed drain (no pinned memory for them, say) left the planner's books:
    the stream says so, and fetches raise, rather than returning what the other drains held."""
    engine = Engine()
    engine.state.drain_bytes = 1  # a drain every step
    engine.session.enable_stream(HS)
    a = Req(num=0, prompt=[1, 2, 3], gen=[4, 5])
    engine.step([(a, 3)])

    def drain(*args):
        raise MemoryError("no pinned memory")

    monkeypatch.setattr(engine.state, "drain", drain)
    with pytest.raises(MemoryError):
        engine.step([(a, 1)])
    monkeypatch.undo()
    status = engine.session.stream_status(HS)
    assert status["meta_complete"] is False and "drain of the device ring" in status["rows_lost"]
    with pytest.raises(RuntimeError, match="lost before they were stored"):
        engine.session.fetch_stream(HS)


def _second_request_without_a_slot(reduce, b_gen):
    """One reduce slot: request a takes it in the first step, b fails for want of one."""
    engine = Engine(acc_slots=1)
    ref = RefStream(HS, 1, reduce=reduce)
    engine.refs = [ref]
    engine.session.enable_stream(HS, reduce=reduce)
    a = Req(num=0, prompt=[1, 2, 3], gen=[4, 0, 1])
    b = Req(num=1, prompt=[2, 3], gen=b_gen)
    engine.step([(a, 3), (b, 2)])
    return engine, ref, a, b


def test_clearing_a_stream_keeps_the_failure_of_a_request_still_running():
    engine, ref, a, b = _second_request_without_a_slot("mean", [1, 2, 3])  # b runs on
    engine.session.clear_stream(HS)
    for _ in range(3):
        engine.step([(a, 1), (b, 1)])
    engine.step([])
    assert engine.session.stream_status(HS)["failed_reqs"] == 1
    with pytest.raises(RuntimeError, match=f"failed request.*{b.rid}"):
        engine.session.fetch_stream(HS)
    check_reduced(ref, decode_rows(*engine.fetch(HS, req_ids=[a.rid])), [a.rid])


def test_a_refused_fetch_leaves_the_running_reductions_as_they_were():
    engine, ref, a, _ = _second_request_without_a_slot("last", [])
    with pytest.raises(RuntimeError, match="failed request"):
        engine.session.fetch_stream(HS)  # refused: a's last goes on
    for _ in range(3):
        engine.step([(a, 1)])
    engine.step([])
    check_reduced(ref, decode_rows(*engine.fetch(HS, req_ids=[a.rid])), [a.rid])
    assert engine.session.stream_status(HS)["tokens_dropped"] == 0
