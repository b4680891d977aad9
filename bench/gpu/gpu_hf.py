"""transformers (sdpa) on the same shape and random weights as bench/gpu/gpu.py: prefill 4x4096 and static-cache
decode at batch 1 and 64 (imported by bench/gpu/gpu.py)."""

from __future__ import annotations

from pathlib import Path

import torch

from bench.gpu.gpu_decode import CONTEXT
from bench.gpu.harness import PREFILL_LEN, PREFILL_SEQS, timed


def hf_model(model_dir: Path):
    """transformers' Llama from the same config, random bf16 weights on the GPU, sdpa attention."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(model_dir)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(
            config, dtype=torch.bfloat16, attn_implementation="sdpa")
    return model.eval()


def hf_prefill(model, vocab: int, reps: int = 3, num_seqs: int = PREFILL_SEQS, seq_len: int = PREFILL_LEN,
               device: str = "cuda") -> float:
    """Median seconds of one forward over [num_seqs, seq_len] with logits of the last token only."""
    ids = torch.randint(0, vocab, (num_seqs, seq_len), device=device)
    with torch.inference_mode():
        return timed(lambda: model(input_ids=ids, logits_to_keep=1), reps)


def hf_decode(model, vocab: int, batch: int, new_tokens: int, context: int = CONTEXT, cache: str | None = "static",
              device: str = "cuda", compile_decode: bool = True) -> dict:
    """Greedy generate: decode-only time = t(1 + new_tokens new) - t(1 new), same prompts; `cache` None is the
    default dynamic cache; compile_decode=False turns off transformers' auto-compile of static-cache decode."""
    ids = torch.randint(0, vocab, (batch, context), device=device)
    extra = {"cache_implementation": cache} if cache else {}

    def gen(n):
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                 min_new_tokens=n, do_sample=False, pad_token_id=0,
                                 disable_compile=not compile_decode, **extra)
        assert out.shape == (batch, context + n), out.shape

    t_full = timed(lambda: gen(1 + new_tokens), reps=1, warmup=1)
    t_one = timed(lambda: gen(1), reps=1, warmup=0)
    return {"tok_s": round(batch * new_tokens / (t_full - t_one), 1), "decode_s": round(t_full - t_one, 3),
            "new_tokens": new_tokens, "context": context, "cache": cache or "dynamic"}


def run_hf(model_dir: Path, cfg: dict, res: dict, save) -> None:
    """transformers on the same shape: prefill 4x4096 and static-cache decode at batch 1 and 64."""
    model = hf_model(model_dir)
    vocab = cfg["vocab_size"]
    seconds = hf_prefill(model, vocab)
    res.setdefault("prefill", {})["transformers_tok_s"] = round(PREFILL_SEQS * PREFILL_LEN / seconds, 1)
    save()
    res["transformers_decode"] = {str(b): hf_decode(model, vocab, b, n) for b, n in ((1, 64), (64, 32))}
    save()
    del model
