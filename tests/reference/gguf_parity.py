"""ortserve against llama.cpp on the same GGUF: tokenization of a mixed corpus, and teacher-forced top-1 agreement.

The converted folder's tokenizer.json must give llama.cpp's token ids (BOS included) and decode them back; then a
few prompts of 32 tokens run through both (all positions at once, llama.cpp with logits_all) and the argmax
after every position is compared. llama.cpp runs as a subprocess of the dev-only `.bench-venv`
(tests/reference/llamacpp_peer.py). Not a test: tests/integration/builder/test_llamacpp_parity.py asserts on it.

    .venv/bin/python -m tests.reference.gguf_parity --gguf .cache/gguf/gemma-3-270m-q4_k_m.gguf \\
        --model-dir .cache/gemma3-270m [--model-dir OTHER_FOLDER ...] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
PEER = Path(__file__).with_name("llamacpp_peer.py")
DEFAULT_PEER_PYTHON = ROOT / ".bench-venv" / "bin" / "python"

# English, code, CJK, emoji, runs of spaces and newlines, leading and trailing spaces.
CORPUS = [
    "Hello world", "The capital of France is", " leading space", "trailing spaces   ", "   ", "\n",
    "whitespace  runs   and\t\ttabs\n\n\n  newline then spaces    \n \r\n end   ",
    "Code: def f(x):\n    return x**2 + 1  # comment\nif a<=b && c!=d: print(f\"{a}\")",
    "Unicode: naïve café Zürich — “quotes” ñ ß Ω 漢字 日本語のテキスト 한국어 العربية עברית हिन्दी",
    "Emoji 🎉🚀👍🏽 👨‍👩‍👧 ☕️ and rare ones: 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𓀀",
    "Digits: 0 1 12 123 1234567890 3.14159 -42 1e-5",
    "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
    "URL https://example.com/a?b=c&d=e#frag and mail name@example.org",
]
# Long enough for 32 tokens each; teacher-forced, so the model's own continuation never matters.
PROMPTS = [
    "The history of the Roman Empire spans more than a thousand years, from the founding of the city to the fall "
    "of Constantinople, and its influence on law, language and architecture is still visible today.",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    a, b = 0, 1\n    for _ in range(n):\n"
    "        a, b = b, a + b\n    return a\n\nprint(fibonacci(10))",
    "Ingredients: 2 cups of flour, 1 teaspoon of baking soda, a pinch of salt, 3 eggs, 1 cup of milk and "
    "half a cup of melted butter. Mix the dry ingredients first, then add the eggs.",
    "Photosynthesis is the process by which green plants use sunlight, water and carbon dioxide to make glucose "
    "and oxygen. It takes place mainly in the chloroplasts of leaf cells.",
]
PROMPT_TOKENS = 32


class Peer:
    """llama.cpp in a subprocess (tests/reference/llamacpp_peer.py), one JSON request per line."""

    def __init__(self, gguf: Path, *, python: Path = DEFAULT_PEER_PYTHON, threads: int = 2,
                 logits_all: bool = False, n_ctx: int = 2048, omp_wait_policy: str | None = None) -> None:
        cmd = [str(python), str(PEER), "--gguf", str(gguf), "--threads", str(threads), "--n-ctx", str(n_ctx)]
        env = dict(os.environ)
        if omp_wait_policy:  # llama.cpp's threads wait at OpenMP barriers: spinning (ACTIVE) or sleeping
            env["OMP_WAIT_POLICY"] = omp_wait_policy
        self.proc = subprocess.Popen(cmd + (["--logits-all"] if logits_all else []), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)

    def ask(self, **req) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"llama.cpp peer died (exit {self.proc.wait()})")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def peer_works(python: Path = DEFAULT_PEER_PYTHON) -> str | None:
    """None when the llama.cpp peer can run here, else why not (not built, or built for another CPU)."""
    if not python.is_file():
        return f"{python} does not exist (INSTALL_ONLY=1 perf/compare_cpu.sh builds it)"
    proc = subprocess.run([str(python), "-c", "import llama_cpp; llama_cpp.llama_backend_init()"],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        return f"llama_cpp does not load in {python} (exit {proc.returncode}: {proc.stderr.strip()[-300:]})"
    return None


@dataclass
class ParityResult:
    tokenization_equal: int
    tokenization_total: int
    mismatches: list[dict]
    top1: dict[str, float]  # model folder -> agreement
    positions: int
    eog: list[int]  # llama.cpp's end-of-generation ids for the file


def all_position_logits(model_dir: Path, ids: list[int], threads: int = 2) -> np.ndarray:
    """float32 [len(ids), vocab]: one prefill of ``ids`` with every position's logits (a plain session)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.log_severity_level = 3
    session = ort.InferenceSession(str(model_dir / "model.onnx"), so, providers=["CPUExecutionProvider"])
    past = [i for i in session.get_inputs() if i.name.startswith("past_key_values.")]
    n = len(ids)
    feed = {"input_ids": np.array([ids], np.int64), "attention_mask": np.ones((1, n), np.int64),
            "position_ids": np.arange(n, dtype=np.int64)[None]}
    dtype = np.float16 if past[0].type == "tensor(float16)" else np.float32
    feed.update({i.name: np.zeros((1, i.shape[1], n, i.shape[3]), dtype) for i in past})
    return session.run(["logits"], feed)[0][0]


def run_parity(gguf: Path, model_dirs: list[Path], *, python: Path = DEFAULT_PEER_PYTHON,
               threads: int = 2) -> ParityResult:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dirs[0] / "tokenizer.json"))
    peer = Peer(gguf, python=python, threads=threads, logits_all=True)
    try:
        theirs = peer.ask(cmd="tokenize", texts=CORPUS, add_special=True)["ids"]
        plain = [tok.encode(text, add_special_tokens=False).ids for text in CORPUS]
        their_text = peer.ask(cmd="detokenize", ids=plain)["texts"]
        mismatches = []
        for text, ref, ids, ref_text in zip(CORPUS, theirs, plain, their_text):
            ours = tok.encode(text, add_special_tokens=True).ids
            back = tok.decode(ids, skip_special_tokens=False)
            if ours != ref or back != ref_text or back != text:
                mismatches.append({"text": text, "ours": ours, "llama.cpp": ref, "decoded": back,
                                   "llama.cpp decoded": ref_text})
        prompts = [tok.encode(p, add_special_tokens=True).ids[:PROMPT_TOKENS] for p in PROMPTS]
        ref_argmax = [peer.ask(cmd="argmax", ids=p)["argmax"] for p in prompts]
        eog = peer.ask(cmd="eog")["eog"]
    finally:
        peer.close()
    top1 = {}
    for folder in model_dirs:
        agree = [np.argmax(all_position_logits(folder, p, threads), axis=-1) == np.array(r)
                 for p, r in zip(prompts, ref_argmax)]
        top1[str(folder)] = float(np.mean(np.concatenate(agree)))
    return ParityResult(len(CORPUS) - len(mismatches), len(CORPUS), mismatches, top1,
                        positions=sum(len(p) for p in prompts), eog=eog)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", type=Path, required=True)
    parser.add_argument("--model-dir", type=Path, action="append", required=True,
                        help="converted folder(s) of the same GGUF (e.g. accuracy levels 4 and 0)")
    parser.add_argument("--peer-python", type=Path, default=DEFAULT_PEER_PYTHON)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    why = peer_works(args.peer_python)
    if why:
        print(f"gguf_parity: {why}", file=sys.stderr)
        return 1
    res = run_parity(args.gguf, args.model_dir, python=args.peer_python, threads=args.threads)
    peer = Peer(args.gguf, python=args.peer_python)
    info = peer.ask(cmd="info")
    peer.close()
    report = {"gguf": str(args.gguf), "cpu": platform.processor() or platform.machine(),
              "llama_cpp": info, "tokenization": f"{res.tokenization_equal}/{res.tokenization_total} texts equal",
              "mismatches": res.mismatches, "top1_agreement": res.top1,
              "positions": res.positions, "prompt_tokens": PROMPT_TOKENS, "eog": res.eog}
    print(json.dumps(report, indent=2, ensure_ascii=False))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
