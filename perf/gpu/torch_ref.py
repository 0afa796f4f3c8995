"""PyTorch bf16 reference on the same GPU and shapes: transformers generate, eager and static cache + compile.

Random weights from a config (no download). Run by bench_gpu in its own process; writes JSON after every
figure. Usage on the device machine: python3 -m perf.gpu.torch_ref --out torch_ref.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from perf.gpu.shapes import HBM_BYTES_PER_S, HF_ARCH, OUTPUT_TOKENS, PROMPT_TOKENS, SHAPES


def make_model(name: str) -> Any:
    """A random-weight bf16 model of ``name``'s shape on the GPU, eval mode."""
    import torch
    import transformers

    s = SHAPES[name]
    common = dict(hidden_size=s["hidden_size"], intermediate_size=s["intermediate_size"],
                  num_hidden_layers=s["num_layers"], num_attention_heads=s["num_heads"],
                  num_key_value_heads=s["num_kv_heads"], vocab_size=s["vocab_size"], head_dim=64,
                  max_position_embeddings=2048, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                  pad_token_id=0)
    cls = transformers.Qwen2Config if HF_ARCH[name] == "qwen2" else transformers.LlamaConfig
    config = cls(**common)
    torch.manual_seed(0)
    with torch.device("cuda"):
        try:
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        except TypeError:  # transformers < 4.56 names it torch_dtype
            model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    return model.eval()


def decode_rate(model: Any, *, static: bool, reps: int = 2) -> dict[str, Any]:
    """Decode tokens/s of greedy generate: (128 - 1) tokens over t(128 tokens) - t(1 token)."""
    import torch

    ids = torch.arange(3, 3 + PROMPT_TOKENS, device="cuda").unsqueeze(0)
    extra = {"cache_implementation": "static"} if static else {}

    def timed(n: int) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, **extra)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    t_warm = time.perf_counter()
    timed(OUTPUT_TOKENS)  # warm-up (the compile, with a static cache)
    timed(OUTPUT_TOKENS)
    warmup_s = time.perf_counter() - t_warm
    rates = []
    for _ in range(reps):
        t1, tn = timed(1), timed(OUTPUT_TOKENS)
        rates.append((OUTPUT_TOKENS - 1) / (tn - t1))
    return {"decode_tokens_per_s": max(rates), "all": rates, "warmup_s": warmup_s}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--deadline-s", type=float, default=280.0)
    args = p.parse_args(argv)
    t_start = time.perf_counter()
    import torch
    import transformers

    data: dict[str, Any] = {"torch": torch.__version__, "transformers": transformers.__version__,
                            "gpu": torch.cuda.get_device_name(0), "shapes": {}}

    def save() -> None:
        args.out.write_text(json.dumps(data, indent=2))

    names = [n for n in args.shapes.split(",") if n]
    # Eager for every shape first (cheap), then static cache + compile (minutes of compiling) while time lasts.
    for variant, static in (("eager", False), ("static_compile", True)):
        for name in sorted(names, key=lambda n: n != "llama-3.2-1b"):
            entry = data["shapes"].setdefault(name, {})
            if time.perf_counter() - t_start > args.deadline_s:
                entry[variant] = {"skipped": "deadline"}
                save()
                continue
            try:
                model = make_model(name)
                params = sum(p.numel() for p in model.parameters())  # tied weights counted once
                entry["bf16_bytes_per_token"] = 2.0 * params
                entry["bf16_tokens_per_s_bound"] = HBM_BYTES_PER_S / (2.0 * params)
                entry[variant] = decode_rate(model, static=static)
            except Exception as exc:  # noqa: BLE001 - recorded; the next shape still runs
                entry[variant] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-2000:]}
            finally:
                model = None
                torch.cuda.empty_cache()
            print(name, variant, entry[variant].get("decode_tokens_per_s"), flush=True)
            save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
