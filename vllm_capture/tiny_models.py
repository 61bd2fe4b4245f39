"""Tiny Hugging Face checkpoints built locally, so tests, the demo and benchmarks need no download.

Each builder writes a random-initialised model (``save_pretrained``) and a word-level tokenizer
trained with the ``tokenizers`` library on a small bundled corpus. The shapes are chosen so that
vLLM's CPU and GPU attention backends accept them (head size 32 or 64).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

# Short sentences; their words become the tokenizer's vocabulary.
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a capture of hidden states from every layer of the model",
    "attention heads write their outputs before the output projection",
    "router logits choose which experts see each token",
    "continuous batching mixes prompts of different lengths in one step",
    "chunked prefill spreads a long prompt over several steps",
    "the ring buffer is drained after every step without blocking",
    "researchers read activations to steer and to understand models",
    "one two three four five six seven eight nine ten",
    "red green blue yellow black white orange purple",
    "monday tuesday wednesday thursday friday saturday sunday",
    "north south east west up down left right",
]

VOCAB_SIZE = 512


def _train_tokenizer(out: Path) -> int:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["<unk>", "<s>", "</s>", "<pad>"])
    tok.train_from_iterator(CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    )
    fast.save_pretrained(out)
    return tok.get_vocab_size()


def _build(out: Path, config, seed: int, random_biases: bool = False) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    # The marker records what was asked for (not config.to_dict(), which save_pretrained rewrites),
    # so a finished build is reused instead of rewritten on every call.
    marker = out / ".vllm-capture-tiny"
    asked = {"class": type(config).__name__, "seed": seed, "config": config.to_diff_dict()}
    if random_biases:
        asked["random_biases"] = True  # absent otherwise, so earlier builds' markers still match
    wanted = json.dumps(asked, sort_keys=True, default=str)
    if marker.exists() and marker.read_text() == wanted and (out / "model.safetensors").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    _train_tokenizer(out)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Random init is tiny (std 0.02); larger weights make per-layer activations distinct enough
    # that an off-by-one layer or row shows up far above float tolerance.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
            elif random_biases and name.endswith(".bias"):
                # HF initialises biases to zero, which would leave a bias path untested.
                p.normal_(0.0, 0.08)
    model.save_pretrained(out, safe_serialization=True)
    marker.write_text(wanted)
    return out


def _common() -> dict:
    return dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )


def build_tiny_llama(out: str | os.PathLike) -> Path:
    """A 4-layer Llama (dense; vLLM's V2 runner on GPU)."""
    from transformers import LlamaConfig

    return _build(Path(out), LlamaConfig(**_common()), seed=0)


def build_tiny_qwen3(out: str | os.PathLike) -> Path:
    """A 4-layer Qwen3 (dense, per-head q/k norm)."""
    from transformers import Qwen3Config

    return _build(Path(out), Qwen3Config(**_common()), seed=1)


def build_tiny_mixtral(out: str | os.PathLike) -> Path:
    """A 4-layer Mixtral (MoE with a traced gate; vLLM's V1 runner on GPU)."""
    from transformers import MixtralConfig

    cfg = _common()
    cfg.update(num_local_experts=4, num_experts_per_tok=2)
    return _build(Path(out), MixtralConfig(**cfg), seed=2)


def build_tiny_qwen3_moe(out: str | os.PathLike) -> Path:
    """A 4-layer Qwen3-MoE (its gate runs inside vLLM's opaque fused-MoE op)."""
    from transformers import Qwen3MoeConfig

    cfg = _common()
    cfg.update(
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        decoder_sparse_step=1,
        norm_topk_prob=True,
    )
    return _build(Path(out), Qwen3MoeConfig(**cfg), seed=3)


def build_tiny_qwen2(out: str | os.PathLike) -> Path:
    """A 4-layer Qwen2 (dense; q/k/v projections with biases, drawn non-zero here)."""
    from transformers import Qwen2Config

    return _build(Path(out), Qwen2Config(**_common()), seed=4, random_biases=True)


def build_tiny_qwen2_moe(out: str | os.PathLike) -> Path:
    """A 4-layer Qwen2-MoE: router gate plus a shared expert with its own sigmoid gate
    (``mlp.shared_expert_gate``, one logit per token; it is not the router)."""
    from transformers import Qwen2MoeConfig

    cfg = _common()
    cfg.update(
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=128,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=False,
    )
    return _build(Path(out), Qwen2MoeConfig(**cfg), seed=5, random_biases=True)


def build_tiny_olmoe(out: str | os.PathLike) -> Path:
    """A 4-layer OLMoE (q/k RMSNorm over all heads at once; top-k weights not renormalised)."""
    from transformers import OlmoeConfig

    cfg = _common()
    cfg.update(num_experts=4, num_experts_per_tok=2, norm_topk_prob=False)
    return _build(Path(out), OlmoeConfig(**cfg), seed=6)


BUILDERS = {
    "llama": build_tiny_llama,
    "qwen3": build_tiny_qwen3,
    "mixtral": build_tiny_mixtral,
    "qwen3_moe": build_tiny_qwen3_moe,
    "qwen2": build_tiny_qwen2,
    "qwen2_moe": build_tiny_qwen2_moe,
    "olmoe": build_tiny_olmoe,
}


def default_cache_dir() -> Path:
    return Path(os.environ.get("VLLM_CAPTURE_TINY_DIR", Path.home() / ".cache" / "vllm-capture" / "tiny"))


def build(name: str, out: str | os.PathLike | None = None) -> Path:
    """Build (or reuse) the tiny model ``name`` and return its folder."""
    if name not in BUILDERS:
        raise ValueError(f"unknown tiny model {name!r}; choose one of {sorted(BUILDERS)}")
    return BUILDERS[name](Path(out) if out is not None else default_cache_dir() / name)
