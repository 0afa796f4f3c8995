"""Teacher-forced top-1 agreement of an ortserve model folder with llama.cpp's llama-server on the same GGUF (issue 45:
the real Qwen2.5-Coder-1.5B in float16 on CUDA against llama.cpp's CUDA run, target >= 95%).

Real code (this repository's own sources) is tokenized with the folder's tokenizer; our graph runs the whole sequence
once on the given provider and takes the argmax after every position; llama-server is asked, for every prefix, for its
one most likely next token (/completion with the token ids, n_predict 1, its prompt cache making each request one
token's work). The same ids go to both, so only the two runtimes' arithmetic differs.

    python -m perf.gpu.top1 --model-dir FOLDER --peer http://127.0.0.1:8401 [--provider cuda] [--tokens 512]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("engine/sampler.py", "engine/scheduler.py", "server/openai/completions.py")  # real code to read


def code_ids(folder: Path, num_tokens: int) -> list[int]:
    """The first ``num_tokens`` ids of this repository's code, as the folder's tokenizer encodes it (BOS and all)."""
    from tokenizers import Tokenizer

    text = "\n\n".join((ROOT / s).read_text() for s in SOURCES)
    ids = Tokenizer.from_file(str(folder / "tokenizer.json")).encode(text).ids
    if len(ids) < num_tokens:
        raise ValueError(f"only {len(ids)} tokens of code, {num_tokens} asked")
    return ids[:num_tokens]


def our_argmax(folder: Path, ids: list[int], provider: str) -> list[int]:
    """The graph's top-1 after every position: one run over the whole sequence (an empty KV row of its length)."""
    import onnxruntime as ort

    providers = ["CUDAExecutionProvider", "CPUExecutionProvider"] if provider == "cuda" else ["CPUExecutionProvider"]
    session = ort.InferenceSession(str(folder / "model.onnx"), providers=providers)
    n = len(ids)
    feeds: dict[str, np.ndarray] = {
        "input_ids": np.array([ids], np.int64), "attention_mask": np.ones((1, n), np.int64),
        "position_ids": np.arange(n, dtype=np.int64)[None], "logits_to_keep": np.array([0], np.int64)}
    for i in session.get_inputs():
        if i.name.startswith("past_key_values."):
            dtype = np.float16 if i.type == "tensor(float16)" else np.float32
            feeds[i.name] = np.zeros((1, i.shape[1], n, i.shape[3]), dtype)  # [1, kvh, n, hd]
    (logits,) = session.run(["logits"], feeds)  # [1, n, vocab] float32
    return [int(x) for x in logits[0].argmax(axis=-1)]


def peer_argmax(url: str, ids: list[int], timeout_s: float = 120.0) -> list[int]:
    """llama-server's most likely next token after every prefix of ``ids``."""
    import httpx

    out = []
    with httpx.Client(base_url=url, timeout=timeout_s) as client:
        for end in range(1, len(ids) + 1):
            r = client.post("/completion", json={"prompt": ids[:end], "n_predict": 1, "n_probs": 1, "temperature": 0,
                                                 "cache_prompt": True, "return_tokens": True})
            r.raise_for_status()
            body = r.json()
            if body.get("tokens"):
                out.append(int(body["tokens"][0]))
            else:
                out.append(int(body["completion_probabilities"][0]["id"]))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", type=Path, required=True)
    p.add_argument("--peer", required=True, help="llama-server's base URL (no /v1)")
    p.add_argument("--provider", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    ids = code_ids(args.model_dir, args.tokens)
    t0 = time.perf_counter()
    ours = our_argmax(args.model_dir, ids, args.provider)
    t1 = time.perf_counter()
    theirs = peer_argmax(args.peer.rstrip("/"), ids)
    t2 = time.perf_counter()
    same = sum(a == b for a, b in zip(ours, theirs))
    result = {"model_dir": str(args.model_dir), "provider": args.provider, "positions": len(ids), "agree": same,
              "agreement": same / len(ids), "ours_s": t1 - t0, "peer_s": t2 - t1,
              "first_disagreements": [i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b][:20]}
    print(f"top-1 agreement {result['agreement']:.1%} ({same}/{len(ids)} positions of code)")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
