"""GPU checks run by hand on the H200 (CI has no GPU): ``benchmarks/gpu_session.sh`` calls this.

``python tests/gpu/gpu_checks.py run --model llama --mode graph --out X.pt`` starts one engine,
captures all three components at once for a batch of concurrent prompts (chunked prefill and
per-request selections included), and saves rows, labels and counters. ``compare`` then checks:
graph vs eager-path rows (labels identical, values bit-identical or the max difference reported),
fidelity against Hugging Face transformers on the same weights, and replay counters.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

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

    path = build(args.model, Path(args.models) / args.model)
    kwargs = dict(dtype="bfloat16", max_model_len=512, max_num_batched_tokens=args.batched_tokens,
                  max_num_seqs=64, seed=0, gpu_memory_utilization=0.3)
    if args.mode == "eager":
        kwargs["enforce_eager"] = True
    elif args.mode == "nograph":
        kwargs["compilation_config"] = {"cudagraph_mode": "NONE"}
    t0 = time.time()
    llm = vc.LLM(str(path), **kwargs) if args.capture else __import__("vllm").LLM(str(path), **kwargs)
    init_s = time.time() - t0
    prompts = make_prompts(args.prompts)
    # Prompts share prefixes: every row is wanted, so prefix-cache reads must be skipped.
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True,
                            skip_reading_prefix_cache=True)
    result = {"init_s": init_s, "mode": args.mode, "model": args.model, "v1": args.v1}
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
    outs = llm.generate(prompts, params, use_tqdm=False)
    gen_s = time.time() - t
    result["tok_s_capturing_all"] = sum(len(o.outputs[0].token_ids) for o in outs) / gen_s
    result["outputs"] = [(o.request_id, list(o.prompt_token_ids), list(o.outputs[0].token_ids))
                         for o in outs]
    result["streams"] = {}
    for s in streams:
        status = api.capture_status(llm, s)
        tensors, meta, layouts = api.fetch_captured(llm, s)
        grouped, gmeta, offsets = api.group_rows(tensors, meta, [o.request_id for o in outs])
        result["streams"][s] = {
            "status": status, "offsets": offsets, "layouts": layouts,
            "layers": {k: v.float() for k, v in grouped.items()},
            "positions": {k: m.positions for k, m in gmeta.items()},
            "token_ids": {k: m.token_ids for k, m in gmeta.items()},
        }
        api.stop_capture(llm, s)
    # Throughput: idle-installed and last-token capture on the same engine.
    llm.generate(prompts, params, use_tqdm=False)
    t = time.time()
    outs = llm.generate(prompts, params, use_tqdm=False)
    result["tok_s_idle"] = sum(len(o.outputs[0].token_ids) for o in outs) / (time.time() - t)
    torch.save(result, args.out)
    print(json.dumps({k: v for k, v in result.items() if k not in ("streams", "outputs")}))
    for s, d in result["streams"].items():
        print(s, json.dumps(d["status"]))


def hf_reference(model_dir: str, outputs, streams) -> dict:
    """Per prompt: HF float32 activations of prompt+generated tokens, hooked like vllm-capture."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).cuda().eval()
    layers = model.model.layers
    refs = []
    for _, prompt_ids, out_ids in outputs:
        ids = torch.tensor([prompt_ids + out_ids[:-1]], device="cuda")
        got = {"hidden_states": {}, "attention_heads": {}, "router_logits": {}}
        hooks = []
        for i, layer in enumerate(layers):
            hooks.append(layer.register_forward_hook(
                lambda m, a, o, i=i: got["hidden_states"].__setitem__(i, (o[0] if isinstance(o, tuple) else o)[0].float().cpu())))
            hooks.append(layer.self_attn.o_proj.register_forward_pre_hook(
                lambda m, a, i=i: got["attention_heads"].__setitem__(i, a[0][0].float().cpu())))
            gate = getattr(getattr(layer, "mlp", None), "gate", None) or getattr(getattr(layer, "block_sparse_moe", None), "gate", None)
            if gate is not None:
                def gate_hook(m, a, o, i=i):
                    t = o[0] if isinstance(o, tuple) else o
                    got["router_logits"][i] = t.reshape(-1, t.shape[-1]).float().cpu()
                hooks.append(gate.register_forward_hook(gate_hook))
        with torch.no_grad():
            model(ids)
        for h in hooks:
            h.remove()
        refs.append(got)
    return refs


def compare(args) -> None:
    graph = torch.load(args.graph, weights_only=False)
    report = {"graph": {k: graph[k] for k in graph if k not in ("streams", "outputs")}}
    for name in ("eager", "nograph"):
        path = getattr(args, name)
        if not path or not Path(path).exists():
            continue
        other = torch.load(path, weights_only=False)
        report[name] = {k: other[k] for k in other if k not in ("streams", "outputs")}
        diffs = {}
        for s, d in graph["streams"].items():
            o = other["streams"].get(s)
            if o is None:
                continue
            same_labels = all(torch.equal(d["positions"][k], o["positions"][k]) and
                              torch.equal(d["token_ids"][k], o["token_ids"][k]) for k in d["positions"])
            max_diff = max(float((d["layers"][k] - o["layers"][k]).abs().max()) if d["layers"][k].numel() else 0.0
                           for k in d["layers"])
            bit = all(torch.equal(d["layers"][k], o["layers"][k]) for k in d["layers"])
            diffs[s] = {"labels_identical": same_labels, "bit_identical": bit, "max_abs_diff": max_diff,
                        "rows": int(next(iter(d["layers"].values())).shape[0])}
        report[f"graph_vs_{name}"] = diffs
    refs = hf_reference(args.model_dir, graph["outputs"], graph["streams"])
    fid = {}
    for s, d in graph["streams"].items():
        worst_abs, worst_rel, checked = 0.0, 0.0, 0
        for layer, rows in d["layers"].items():
            pos = d["positions"][layer]
            for i in range(len(d["offsets"]) - 1):
                a, b = d["offsets"][i], d["offsets"][i + 1]
                ref = refs[i][s].get(layer)
                if ref is None or a == b:
                    continue
                want = ref[pos[a:b].long()]
                got = rows[a:b]
                err = (got - want).abs()
                worst_abs = max(worst_abs, float(err.max()))
                worst_rel = max(worst_rel, float((err / (want.abs() + 1e-2)).max()))
                checked += b - a
        fid[s] = {"max_abs": worst_abs, "max_rel": worst_rel, "rows_checked": checked}
    report["fidelity_vs_hf_fp32"] = fid
    Path(args.report).write_text(json.dumps(report, indent=1, default=str))
    print(json.dumps(report, indent=1, default=str))


def main() -> None:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--model", default="llama")
    r.add_argument("--models", default="/tmp/tiny")
    r.add_argument("--mode", choices=["graph", "eager", "nograph"], default="graph")
    r.add_argument("--v1", action="store_true")
    r.add_argument("--no-capture", dest="capture", action="store_false")
    r.add_argument("--prompts", type=int, default=48)
    r.add_argument("--max-tokens", type=int, default=16)
    r.add_argument("--batched-tokens", type=int, default=256)
    r.add_argument("--out", required=True)
    r.add_argument("--inproc", action="store_true", help="run the engine in this process")
    r.add_argument("--stack-dump-s", type=float, default=0,
                   help="dump every thread's stack and exit after this many seconds")
    c = sub.add_parser("compare")
    c.add_argument("--graph", required=True)
    c.add_argument("--eager")
    c.add_argument("--nograph")
    c.add_argument("--model-dir", required=True)
    c.add_argument("--report", required=True)
    args = p.parse_args()
    run(args) if args.cmd == "run" else compare(args)


if __name__ == "__main__":
    main()
