"""GPU checks run by hand on the H200 (CI has no GPU): ``benchmarks/gpu_session.sh`` calls this.

``python tests/gpu/gpu_checks.py run --model llama --mode graph --out X.pt`` starts one engine,
captures all three components at once for dozens of concurrent prompts of different lengths
(chunked prefill included), and saves rows, labels and every rank's counters. ``compare`` checks
one run against Hugging Face transformers float32 on the same weights (prompt by prompt, so a row
attributed to the wrong request or position shows as a large error) and against other runs of the
same prompts (eager path, no graphs, tensor_parallel_size=1): rows matched by label, bit identity
or the largest difference (``--identical NAME``: a failure unless run NAME's rows are all
bit-identical). Each generate whose rows are compared queues all its requests before the
engine's first step (``generate_together``), so that runs of the same prompts run the same steps:
a row's bf16 value depends on its batch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # tests.engine_support

PROMPT_WORDS = ("the quick brown fox jumps over the lazy dog a capture of hidden states from every "
                "layer of the model attention heads write their outputs before the output "
                "projection router logits choose which experts see each token").split()


def make_prompts(n: int) -> list[str]:
    out = []
    for i in range(n):
        length = 3 + (i * 7) % 40 + (90 if i % 11 == 0 else 0)
        out.append(" ".join(PROMPT_WORDS[(i + j) % len(PROMPT_WORDS)] for j in range(length)))
    return out


def run(args) -> None:
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    if args.inproc:
        # One process (no EngineCore subprocess), so a hang can be diagnosed from its stacks.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if args.stack_dump_s:
        import faulthandler

        faulthandler.dump_traceback_later(args.stack_dump_s, exit=True)
    if args.v1:
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    import vllm_capture as vc
    from vllm import SamplingParams
    from vllm_capture import api
    from vllm_capture.tiny_models import build

    from tests.engine_support import generate_together

    path = build(args.model, Path(args.models) / args.model)
    kwargs = dict(dtype="bfloat16", max_model_len=512, max_num_batched_tokens=args.batched_tokens,
                  max_num_seqs=args.max_num_seqs, seed=0, gpu_memory_utilization=0.3,
                  tensor_parallel_size=args.tp)
    compiles = record_capture_compiles() if args.inproc else None
    if args.mode == "eager":
        kwargs["enforce_eager"] = True
    elif args.mode == "nograph":
        kwargs["compilation_config"] = {"cudagraph_mode": "NONE"}
    t0 = time.time()
    llm = vc.LLM(str(path), **kwargs) if args.capture else __import__("vllm").LLM(str(path), **kwargs)
    init_s = time.time() - t0
    if compiles is not None:
        compiles.loaded = True
    prompts = make_prompts(args.prompts)
    # Prompts share prefixes: every row is wanted, so prefix-cache reads must be skipped.
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True,
                            skip_reading_prefix_cache=True)
    result = {"init_s": init_s, "mode": args.mode, "model": args.model, "v1": args.v1, "tp": args.tp,
              "batch_invariant": batch_invariant()}
    if not args.capture:
        llm.generate(prompts, params, use_tqdm=False)
        t = time.time()
        outs = llm.generate(prompts, params, use_tqdm=False)
        result["tok_s"] = sum(len(o.outputs[0].token_ids) for o in outs) / (time.time() - t)
        torch.save(result, args.out)
        print(json.dumps(result))
        return
    streams = [s for s in vc.COMPONENTS if api.capture_status(llm, s)["hooked_layers"] > 0]
    for s in streams:
        api.start_capture(llm, s)
    t = time.time()
    outs = generate_together(llm, prompts, params)
    gen_s = time.time() - t
    result["tok_s_capturing_all"] = sum(len(o.outputs[0].token_ids) for o in outs) / gen_s
    result["outputs"] = [(o.request_id, list(o.prompt_token_ids), list(o.outputs[0].token_ids))
                         for o in outs]
    result["streams"] = {}
    for s in streams:
        status = api.capture_status(llm, s)
        # Every rank's counters: under tensor parallelism all ranks must replay together.
        status["per_rank"] = [{k: r.get(k) for k in ("tp_rank", "graph_replays", "eager_capture_forwards",
                                                 "tokens_stored")}
                              for r in api.capture_status(llm, s, all_ranks=True)]
        tensors, meta, layouts = api.fetch_captured(llm, s)
        grouped, gmeta, offsets = api.group_rows(tensors, meta, [o.request_id for o in outs])
        result["streams"][s] = {
            "status": status, "offsets": offsets, "layouts": layouts,
            "layers": {k: v.float() for k, v in grouped.items()},
            "positions": {k: m.positions for k, m in gmeta.items()},
            "token_ids": {k: m.token_ids for k, m in gmeta.items()},
        }
        api.stop_capture(llm, s)
    # Two layers of each stream on, the others' graph nodes switched off: the same prompts must
    # give the same rows for those layers, and the other layers none.
    result["partial"] = {}
    for s in streams:
        layers = sorted(result["streams"][s]["layers"])
        chosen = [layers[0], layers[-1]]
        api.start_capture(llm, s, layers=chosen)
        idle_nodes = api.capture_status(llm, s)["graph_nodes"]
        again = generate_together(llm, prompts, params)
        status = api.capture_status(llm, s)
        tensors, meta, _ = api.fetch_captured(llm, s)
        grouped, _, _ = api.group_rows(tensors, meta, [o.request_id for o in again])
        full = result["streams"][s]["layers"]
        result["partial"][s] = {
            "layers": chosen, "layers_returned": sorted(grouped),
            "max_abs_diff": {k: float((v.float() - full[k]).abs().max()) if v.shape == full[k].shape
                             else f"shape {tuple(v.shape)} != {tuple(full[k].shape)}"
                             for k, v in grouped.items()},
            "graph_nodes": status["graph_nodes"], "graph_nodes_at_start": idle_nodes,
            "graph_replays": status["graph_replays"],
        }
        api.stop_capture(llm, s)
    # Reductions of the same prompts: decode steps repeat the last step's plan (no planning, no
    # upload), so "last" must give each request's last row of the all-row run bit for bit, and
    # "mean" the mean of its rows.
    result["reduced"] = {}
    for s in streams:
        full = result["streams"][s]
        offsets = full["offsets"]
        result["reduced"][s] = {}
        for reduce in ("last", "mean"):
            api.start_capture(llm, s, reduce=reduce)
            timers = api.capture_status(llm, s)["host_timers"]
            again = generate_together(llm, prompts, params)
            after = api.capture_status(llm, s)["host_timers"]
            tensors, meta, _ = api.fetch_captured(llm, s)
            grouped, _, _ = api.group_rows(tensors, meta, [o.request_id for o in again])
            worst_abs, worst_rel = 0.0, 0.0
            for layer, rows in grouped.items():
                ref = full["layers"][layer]
                want = torch.stack([ref[b - 1] if reduce == "last" else ref[a:b].mean(0)
                                    for a, b in zip(offsets[:-1], offsets[1:])])
                err = (rows.float() - want).abs()
                worst_abs = max(worst_abs, float(err.max()))
                worst_rel = max(worst_rel, float((err.max(dim=1).values
                                                  / want.abs().max(dim=1).values.clamp(min=1e-6)).max()))
            result["reduced"][s][reduce] = {
                "layers": len(grouped), "rows_per_layer": sorted({len(v) for v in grouped.values()}),
                "max_abs_diff": worst_abs, "max_rel_rownorm": worst_rel,
                "steps": after["steps"] - timers["steps"],
                "plan_uploads": after["plan_uploads"] - timers["plan_uploads"]}
            api.stop_capture(llm, s)
    result["graph_nodes_idle"] = api.capture_status(llm, streams[0])["graph_nodes"]
    # Throughput: idle-installed and last-token capture on the same engine.
    llm.generate(prompts, params, use_tqdm=False)
    t = time.time()
    outs = llm.generate(prompts, params, use_tqdm=False)
    result["tok_s_idle"] = sum(len(o.outputs[0].token_ids) for o in outs) / (time.time() - t)
    if compiles is not None:
        result["capture_kernel_compiles"] = compiles.summary()
    torch.save(result, args.out)
    print(json.dumps({k: v for k, v in result.items() if k not in ("streams", "outputs")}))
    for s, d in result["streams"].items():
        print(s, json.dumps(d["status"]))


class CaptureCompiles:
    """Triton compiles of vllm_capture's kernels in this process, by phase: at load outside and
    inside CUDA-graph capture, and after load (every variant must be compiled before capture)."""

    def __init__(self) -> None:
        self.loaded = False
        self.counts = {"load": 0, "load_in_graph_capture": 0, "after_load": 0}
        self.after_load: list[str] = []

    def __call__(self, *, fn, repr, **_) -> None:
        if not fn.module.startswith("vllm_capture"):
            return
        if self.loaded:
            self.counts["after_load"] += 1
            self.after_load.append(repr[:300])
        elif torch.cuda.is_current_stream_capturing():
            self.counts["load_in_graph_capture"] += 1
            self.after_load.append("in capture: " + repr[:300])
        else:
            self.counts["load"] += 1

    def summary(self) -> dict:
        return {**self.counts, "late": self.after_load[:8]}


def record_capture_compiles() -> CaptureCompiles:
    """Count vllm_capture's Triton compiles from now on (the engine must run in this process)."""
    from triton import knobs

    hook = CaptureCompiles()
    knobs.runtime.jit_post_compile_hook = hook
    return hook


def stop_token_check(args) -> None:
    """Rows of requests that stop on a stop token, against their outputs: how many rows past the
    output's last fed position each request feeds (with async scheduling, vLLM's GPU default, the
    README says one: the stop token itself), and that ``capture()`` returns exactly prompt plus
    ``G - 1`` rows. The stop token is the generated token most requests reach."""
    from collections import Counter

    import vllm_capture as vc
    from vllm import SamplingParams
    from vllm_capture import api
    from vllm_capture.tiny_models import build

    path = build(args.model, Path(args.models) / args.model)
    llm = vc.LLM(str(path), dtype="bfloat16", max_model_len=512, max_num_seqs=64, seed=0,
                 gpu_memory_utilization=0.3)
    config = llm.llm_engine.vllm_config.scheduler_config
    prompts = make_prompts(args.prompts)
    common = dict(max_tokens=args.max_tokens, temperature=0.0, skip_reading_prefix_cache=True)
    free = llm.generate(prompts, SamplingParams(ignore_eos=True, **common), use_tqdm=False)
    reached = Counter(t for o in free for t in set(o.outputs[0].token_ids[1:-1]))
    stop = reached.most_common(1)[0][0]
    params = SamplingParams(stop_token_ids=[stop], **common)
    api.start_capture(llm, "hidden_states", layers=[0])
    outs = llm.generate(prompts, params, use_tqdm=False)
    tensors, meta, _ = api.fetch_captured(llm, "hidden_states")
    api.stop_capture(llm, "hidden_states")
    _, gmeta, offsets = api.group_rows(tensors, meta, [o.request_id for o in outs])
    positions, token_ids = gmeta[0].positions, gmeta[0].token_ids
    extra = {"stop_token": Counter(), "eos": Counter(), "length": Counter()}
    past_rows_ok = True
    for i, o in enumerate(outs):
        out = o.outputs[0]
        fed = len(o.prompt_token_ids) + len(out.token_ids) - 1
        a, b = offsets[i], offsets[i + 1]
        # vLLM's stop_reason: the stop token's id, or None for an end-of-sequence token.
        reason = ("stop_token" if out.stop_reason == stop
                  else "eos" if out.finish_reason == "stop" else out.finish_reason)
        extra.setdefault(reason, Counter())[b - a - fed] += 1
        for r in range(a + fed, b):  # each row past the output: position and token it fed
            k = r - a - fed
            past_rows_ok &= int(positions[r]) == fed + k
            past_rows_ok &= k > 0 or int(token_ids[r]) == out.token_ids[-1]
    result = vc.capture(llm, prompts, sampling_params=params, layers=[0])
    capture_rows = Counter(
        (result.offsets[i + 1] - result.offsets[i])
        - (len(o.prompt_token_ids) + len(o.outputs[0].token_ids) - 1)
        for i, o in enumerate(result.outputs))
    report = {"async_scheduling": config.async_scheduling, "stop_token": stop,
              "rows_past_output_by_finish": {k: dict(v) for k, v in extra.items() if v},
              "rows_past_output_are_stop_token_then_on": past_rows_ok,
              "capture_rows_past_output": dict(capture_rows)}
    report["ok"] = past_rows_ok and set(capture_rows) == {0} and set(extra["length"]) <= {0}
    Path(args.report).write_text(json.dumps(report, indent=1, default=str))
    print(json.dumps(report, default=str))
    exit_unless(report["ok"])


def matched_rows(d: dict, o: dict) -> dict:
    """Rows of two runs at the same (prompt, position, token id), compared value by value.

    Greedy decoding in bf16 can pick different tokens once numerics differ (other kernels, another
    tensor-parallel split), so each prompt is compared up to the first row whose label differs.
    """
    compared = total = 0
    max_diff = 0.0
    differing = {}  # layer -> rows that differ, and the first one's (prompt, position)
    for layer, rows in d["layers"].items():
        other = o["layers"].get(layer)
        if other is None:
            return {"error": f"layer {layer} missing in the other run"}
        for i in range(len(d["offsets"]) - 1):
            a, b = d["offsets"][i], d["offsets"][i + 1]
            oa, ob = o["offsets"][i], o["offsets"][i + 1]
            n = min(b - a, ob - oa)
            same = ((d["positions"][layer][a:a + n] == o["positions"][layer][oa:oa + n])
                    & (d["token_ids"][layer][a:a + n] == o["token_ids"][layer][oa:oa + n]))
            k = n if bool(same.all()) else int((~same).nonzero()[0, 0])
            total += b - a
            compared += k
            if k:
                x, y = rows[a:a + k], other[oa:oa + k]
                max_diff = max(max_diff, float((x - y).abs().max()))
                rows_differ = (x != y).reshape(k, -1).any(dim=1).nonzero()[:, 0]
                if len(rows_differ):
                    entry = differing.setdefault(str(layer), {"rows": 0, "first": None})
                    entry["rows"] += len(rows_differ)
                    if entry["first"] is None:
                        position = int(d["positions"][layer][a + int(rows_differ[0])])
                        entry["first"] = {"prompt": i, "position": position}
    return {"rows_compared": compared, "rows_total": total, "bit_identical": not differing,
            "max_abs_diff": max_diff, "differing_by_layer": differing}


def compare(args) -> None:
    from tests.engine_support import HFReference

    graph = torch.load(args.run, weights_only=False)
    report = {"run": {k: graph[k] for k in graph if k not in ("streams", "outputs")}}
    for item in args.against:
        name, _, path = item.partition("=")
        if not Path(path).exists():
            report[f"run_vs_{name}"] = f"missing: {path}"
            continue
        other = torch.load(path, weights_only=False)
        report[name] = {k: other[k] for k in other if k not in ("streams", "outputs")}
        report[f"run_vs_{name}"] = {s: matched_rows(d, other["streams"][s])
                                    for s, d in graph["streams"].items() if s in other["streams"]}
    hf = HFReference(args.model_dir)
    fid = {}
    for s, d in graph["streams"].items():
        worst_abs, worst_rel, checked = 0.0, 0.0, 0
        for layer, rows in d["layers"].items():
            pos = d["positions"][layer]
            for i, (_, prompt_ids, out_ids) in enumerate(graph["outputs"]):
                a, b = d["offsets"][i], d["offsets"][i + 1]
                ref = hf.run(prompt_ids + out_ids[:-1]).get(s, {}).get(layer)
                if ref is None or a == b:
                    continue
                want = ref[pos[a:b].long()].float()
                err = (rows[a:b] - want).abs()
                worst_abs = max(worst_abs, float(err.max()))
                worst_rel = max(worst_rel, float((err.max(dim=1).values
                                                  / want.abs().max(dim=1).values.clamp(min=1e-6)).max()))
                checked += b - a
        fid[s] = {"max_abs": worst_abs, "max_rel_rownorm": worst_rel, "rows_checked": checked}
    report["fidelity_vs_hf_fp32"] = fid
    report["problems"] = run_problems(graph, report, fid, args.max_rel, args.identical)
    report["ok"] = not report["problems"]
    Path(args.report).write_text(json.dumps(report, indent=1, default=str))
    print(json.dumps(report, indent=1, default=str))
    exit_unless(report["ok"])


# ``last`` is a row of the all-row run, bit for bit; ``mean`` is summed in float32 on the device
# and rounded to bf16 once, where the reference averages bf16 rows in float32.
MEAN_MAX_REL = 0.02


def batch_invariant() -> bool:
    """Whether this process's engines run vLLM's batch-invariant kernels: ``VLLM_BATCH_INVARIANT``
    as ``vllm.envs`` reads it (read here, since vLLM caches its envs once an engine has started)."""
    return bool(int(os.environ.get("VLLM_BATCH_INVARIANT", "0")))


def kernels_note(this: bool | None, other: bool | None) -> str:
    """Why two runs' rows may differ by a bf16 step, from their kernel modes (None: a run saved
    before the mode was recorded, nothing said)."""
    if this is None or other is None:
        return ""
    if this != other:
        return f"; the runs differ in VLLM_BATCH_INVARIANT ({int(this)} here, {int(other)} there)"
    if not this:
        return ("; both on vLLM's default kernels, which can round a bf16 step apart from one "
                "engine start to another: compare under VLLM_BATCH_INVARIANT=1")
    return ""


def run_problems(graph: dict, report: dict, fid: dict, max_rel: float | None,
                 identical: list[str] = ()) -> list[str]:
    """What makes a ``compare`` fail: rows missing, a layer subset's rows not those of the full
    run, a reduction off its reference, another run with no row to compare, a run named in
    ``identical`` whose rows are not all bit-identical to this one's, and (with ``max_rel``, for
    a dense model: a MoE's routing flips amplify bf16 rounding) rows far from HF."""
    problems = []
    for s, f in fid.items():
        if f["rows_checked"] == 0:
            problems.append(f"{s}: no row checked against HF")
        elif max_rel is not None and f["max_rel_rownorm"] > max_rel:
            problems.append(f"{s}: {f['max_rel_rownorm']:.4f} from HF, above {max_rel}")
    for s, part in graph.get("partial", {}).items():
        diffs = part["max_abs_diff"].values()
        if part["layers_returned"] != part["layers"] or any(d != 0.0 for d in diffs):
            problems.append(f"{s}: a layer subset's rows are not the full run's")
    for s, reductions in graph.get("reduced", {}).items():
        if reductions["last"]["max_abs_diff"] != 0.0:
            problems.append(f"{s}: last is not the all-row run's last row")
        if reductions["mean"]["max_rel_rownorm"] > MEAN_MAX_REL:
            problems.append(f"{s}: mean {reductions['mean']['max_rel_rownorm']:.4f} off")
    for key, runs in report.items():
        if key.startswith("run_vs_") and isinstance(runs, dict):
            name = key[len("run_vs_"):]
            for s, m in runs.items():
                if m.get("error") or not m.get("rows_compared"):
                    problems.append(f"{key} {s}: {m.get('error') or 'no row compared'}")
                elif name in identical and not (
                        m["bit_identical"] and m["rows_compared"] == m["rows_total"]):
                    where = "; ".join(
                        f"layer {layer}: {d['rows']} differing row(s), the first at prompt "
                        f"{d['first']['prompt']} position {d['first']['position']}"
                        for layer, d in m.get("differing_by_layer", {}).items())
                    note = kernels_note(graph.get("batch_invariant"),
                                        (report.get(name) or {}).get("batch_invariant"))
                    problems.append(f"{key} {s}: not bit-identical ({m['rows_compared']} of "
                                    f"{m['rows_total']} rows compared, max abs diff "
                                    f"{m['max_abs_diff']}{'; ' + where if where else ''}){note}")
    for name in identical:
        if not isinstance(report.get(f"run_vs_{name}"), dict):
            problems.append(f"--identical {name}: no such --against run "
                            f"({report.get(f'run_vs_{name}', 'not given')})")
    return problems


def exit_unless(ok: bool) -> None:
    """A check's exit status: 1 when it failed, so the session script's rc says so."""
    if not ok:
        sys.exit(1)


def dtype_drift(args) -> None:
    """Hugging Face alone, bfloat16 against float32, on the prompts ``run`` uses: how far the
    dtype by itself moves each component, per layer. No vLLM and no capture code: a bound on what
    the engine-vs-HF fidelity check can show (MoE routing flips between near-tied experts
    amplify bf16 rounding in the layers after the flip)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.engine_support import HFReference
    from vllm_capture.tiny_models import build

    path = build(args.model, Path(args.models) / args.model)
    tok = AutoTokenizer.from_pretrained(str(path))
    ref32 = HFReference(path)
    ref16 = HFReference(path)
    ref16.model = AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch.bfloat16,
                                                       attn_implementation="eager").eval()
    ref16.layers = list(ref16.model.model.layers)
    worst: dict = {}
    for prompt in make_prompts(args.prompts):
        ids = tok(prompt)["input_ids"]
        a, b = ref32.run(ids), ref16.run(ids)
        for comp, layers in a.items():
            for layer, want in layers.items():
                err = float((b[comp][layer].float() - want).abs().max())
                key = f"{comp}/{layer}"
                worst[key] = max(worst.get(key, 0.0), err)
    report = {"model": args.model, "prompts": args.prompts, "max_abs_bf16_vs_fp32": worst}
    Path(args.report).write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


def graph_nodes_check(args) -> None:
    """The driver calls of ``graph_nodes`` on a real graph, no engine: capture two sites' kernels
    (each followed by a torch op) into a KeptCUDAGraph, then replay it with a site idle (from a
    copy without that site's node), with it on again (torch's own replay), and with both idle.
    The execution counters say which kernels ran; the torch ops must run in every replay; the
    registry's replay counts say the same. The stream a copy is launched on is the current one's
    raw handle, on any stream."""
    from vllm_capture.capture_graph import graph_nodes
    from vllm_capture.kernels import launch_capture, warmup
    from vllm_capture.kernels import layout as L

    dev = torch.device("cuda")
    warmup(dev, [torch.bfloat16])
    nodes = graph_nodes.GraphNodes(graph_nodes.load_driver())
    graph_nodes.install(nodes)
    W, T = 96, 8
    x = torch.randn(T, W, dtype=torch.bfloat16, device=dev)
    ids = torch.arange(T, dtype=torch.int32, device=dev)
    meta, plan = L.new_plan_buffers(T, dev)
    ring, labels = L.new_ring_buffers(T, W, torch.bfloat16, dev)
    acc = L.new_acc_buffers(1, W, dev)
    sites = [L.new_site_buffer(dev, enabled=False) for _ in range(2)]
    out = torch.zeros(1, device=dev)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for site in sites:
            launch_capture(x, None, ids, meta, plan, site, ring, labels, *acc)
            nodes.note_launch(site.data_ptr(), torch.cuda.current_stream().cuda_stream)
            out.add_(1)
    counts = lambda: [int(s[L.SITE_EXECUTIONS]) for s in sites]  # noqa: E731

    def replay() -> list[int]:
        graph.replay()
        torch.cuda.synchronize()
        return counts()

    report = {"class": type(graph).__name__, "status_after_capture": nodes.status()}
    report["both_on"] = replay()
    nodes.set_sites({sites[0].data_ptr(): False})
    report["status_site0_off"] = nodes.status()
    report["site0_off"] = replay()
    report["site0_off_again"] = replay()
    nodes.set_sites({sites[0].data_ptr(): True})
    report["site0_on_again"] = replay()
    nodes.set_sites({sites[0].data_ptr(): False, sites[1].data_ptr(): False})
    report["both_off"] = replay()
    report["torch_op_runs"] = float(out.item())
    # Three of the five replays ran a copy; torch's two ran no idle site's node.
    end = nodes.status()
    report["replays_counted"] = [end["copy_replays"], end["idle_nodes_replayed"]]
    # Replays launch on the handle graph_nodes reads; torch's, on the default and a side stream.
    streams = []
    for s in (torch.cuda.current_stream(), stream):
        with torch.cuda.stream(s):
            streams.append(graph_nodes._current_stream() == torch.cuda.current_stream().cuda_stream)
    report["raw_stream_matches"] = streams
    report["ok"] = (report["raw_stream_matches"] == [True, True]
                    and report["replays_counted"] == [3, 0]
                    and report["both_on"] == [1, 1] and report["site0_off"] == [1, 2]
                    and report["site0_off_again"] == [1, 3] and report["site0_on_again"] == [2, 4]
                    and report["both_off"] == [2, 4] and report["torch_op_runs"] == 10.0
                    and report["status_after_capture"]["nodes"] == 2
                    and report["status_site0_off"]["nodes_left_out"] == 1)
    Path(args.report).write_text(json.dumps(report, indent=1))
    print(json.dumps(report))
    exit_unless(report["ok"])


def drain_order_check(args) -> None:
    """A drain's gather on the device (no engine): pending ring rows of the enabled sites, in a
    given order or as they are, with one site's labels, against the same rows picked on the
    host."""
    import numpy as np

    from vllm_capture.capture_graph.state import CaptureGraphState

    dev = torch.device(args.device)
    state = CaptureGraphState(device=dev, capacity=64, ring_slots=2)
    for layer in range(3):
        state.add_site("hidden_states", layer, f"model.layers.{layer}", 96, torch.bfloat16)
    state.allocate()
    rng = np.random.default_rng(0)
    report = {"device": str(dev), "cases": []}
    # direct: past gather_bytes, each site's rows copied from the ring as they are (no order).
    for layers, start, n, ordered, direct in ((None, 0, 50, True, False), ({0, 2}, 7, 41, True, False),
                                              ({1}, 3, 64, False, False), (None, 64, 64, True, False),
                                              (None, 5, 59, False, True), ({0, 2}, 64, 40, False, True)):
        state.gather_bytes = 0 if direct else 256 << 20
        state.set_enabled("hidden_states", layers)
        [group] = state.groups["hidden_states"]
        group.ring.copy_(torch.randn(group.ring.shape).to(torch.bfloat16))
        group.labels.copy_(torch.from_numpy(rng.integers(0, 1 << 20, group.labels.shape)))
        buf = state.streams["hidden_states"]
        buf.pending_start, buf.offset = start, start + n
        order = rng.permutation(n) if ordered else None
        gathers = state.gathers("hidden_states")
        drained = state.drain("hidden_states", order)
        drained.wait()
        ring, labels = group.ring.cpu(), group.labels.cpu()
        rows = np.arange(start, start + n) if order is None else start + order
        ok = True
        for i, site in enumerate(group.sites):
            if not site.enabled:
                ok &= site.layer_id not in drained.layers
                continue
            got_rows, got_labels = drained.layers[site.layer_id]
            ok &= torch.equal(got_rows, ring[i, torch.from_numpy(rows)])
            first = group.enabled[0]
            ok &= torch.equal(got_labels, labels[first, torch.from_numpy(rows)])
        ok &= gathers == (not direct)
        report["cases"].append({"layers": None if layers is None else sorted(layers),
                                "start": start, "rows": n, "ordered": ordered, "direct": direct,
                                "ok": bool(ok)})
        buf.copies.clear()
        buf.pending_start = buf.offset = 0
    report["ok"] = all(c["ok"] for c in report["cases"])
    Path(args.report).write_text(json.dumps(report, indent=1))
    print(json.dumps(report))
    exit_unless(report["ok"])


def main() -> None:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--model", default="llama")
    r.add_argument("--models", default="/tmp/tiny")
    r.add_argument("--mode", choices=["graph", "eager", "nograph"], default="graph")
    r.add_argument("--v1", action="store_true")
    r.add_argument("--tp", type=int, default=1, help="tensor_parallel_size")
    r.add_argument("--no-capture", dest="capture", action="store_false")
    r.add_argument("--prompts", type=int, default=48)
    r.add_argument("--max-tokens", type=int, default=16)
    r.add_argument("--batched-tokens", type=int, default=256)
    r.add_argument("--max-num-seqs", type=int, default=64)
    r.add_argument("--out", required=True)
    r.add_argument("--inproc", action="store_true",
                   help="run the engine in this process (and count the capture kernels' compiles)")
    r.add_argument("--stack-dump-s", type=float, default=0,
                   help="dump every thread's stack and exit after this many seconds")
    c = sub.add_parser("compare")
    c.add_argument("--run", required=True, help="the run checked against HF and the others")
    c.add_argument("--against", action="append", default=[], metavar="NAME=PATH",
                   help="another run of the same prompts to compare rows with (repeatable)")
    c.add_argument("--model-dir", required=True)
    c.add_argument("--report", required=True)
    c.add_argument("--identical", action="append", default=[], metavar="NAME",
                   help="fail unless the --against run NAME has every row bit-identical "
                        "(both runs queue their requests before the first step)")
    c.add_argument("--max-rel", type=float, default=None,
                   help="fail when a row is further from HF fp32 than this (relative to its norm)")
    d = sub.add_parser("dtype-drift", help="HF bf16 vs HF fp32, per layer (CPU is enough)")
    d.add_argument("--model", default="qwen3_moe")
    d.add_argument("--models", default="/tmp/tiny")
    d.add_argument("--prompts", type=int, default=48)
    d.add_argument("--report", required=True)
    g = sub.add_parser("graph-nodes", help="switching capture nodes of a real CUDA graph")
    g.add_argument("--report", required=True)
    o = sub.add_parser("drain-order", help="a drain's gather, ordered and not, no engine")
    o.add_argument("--device", default="cuda")
    o.add_argument("--report", required=True)
    st = sub.add_parser("stop-token", help="rows of requests that stop on a stop token")
    st.add_argument("--model", default="llama")
    st.add_argument("--models", default="/tmp/tiny")
    st.add_argument("--prompts", type=int, default=48)
    st.add_argument("--max-tokens", type=int, default=16)
    st.add_argument("--report", required=True)
    args = p.parse_args()
    {"run": run, "compare": compare, "dtype-drift": dtype_drift,
     "graph-nodes": graph_nodes_check, "drain-order": drain_order_check,
     "stop-token": stop_token_check}[args.cmd](args)


if __name__ == "__main__":
    main()
