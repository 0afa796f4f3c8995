"""llama.cpp on a GGUF as a subprocess peer, driven by JSON lines on stdin (one JSON answer per line on stdout).

Runs under the dev-only llama-cpp-python venv (`INSTALL_ONLY=1 perf/compare_cpu.sh` builds `.bench-venv/`), never
under ortserve's: it imports llama_cpp and numpy only. tests/reference/gguf_parity.py and perf/compare_gguf.py start it.

    .bench-venv/bin/python tests/reference/llamacpp_peer.py --gguf FILE --threads 2 [--logits-all]

Requests:
    {"cmd": "tokenize", "texts": [...], "add_special": true}  -> {"ids": [[...], ...]}
    {"cmd": "detokenize", "ids": [[...], ...]}                -> {"texts": [...]}
    {"cmd": "argmax", "ids": [...]}                           -> {"argmax": [...]} (needs --logits-all: the
                                                                  top-1 token after every position, teacher-forced)
    {"cmd": "generate", "ids": [...], "max_tokens": N}        -> {"tokens": [...], "prompt_s": s, "decode_s": s}
                                                                  (greedy, eos ignored; prompt_s: the prompt's
                                                                  eval, decode_s: the N - 1 steps after it)
    {"cmd": "eog"}                                            -> {"eog": [...]} (every id llama.cpp's vocabulary
                                                                  treats as end-of-generation)
    {"cmd": "info"}                                           -> {"system_info": ..., "version": ...}
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import llama_cpp
import numpy as np
from llama_cpp import Llama, llama_print_system_info
from llama_cpp import __version__ as llama_cpp_version


def last_argmax(llm: Llama) -> int:
    """The top token after the last evaluated position.

    NOTE(bench): without logits_all, llama-cpp-python no longer copies logits into ``llm.scores``; read the
    last position's row from the context (a view, no copy).
    """
    return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--n-ctx", type=int, default=2048)
    parser.add_argument("--logits-all", action="store_true")
    args = parser.parse_args()
    llm = Llama(model_path=args.gguf, n_threads=args.threads, n_threads_batch=args.threads, n_ctx=args.n_ctx,
                n_batch=512, logits_all=args.logits_all, verbose=False)
    for line in sys.stdin:
        req = json.loads(line)
        cmd = req["cmd"]
        if cmd == "tokenize":
            out = {"ids": [llm.tokenize(t.encode("utf-8"), add_bos=req.get("add_special", True), special=True)
                           for t in req["texts"]]}
        elif cmd == "detokenize":
            out = {"texts": [llm.detokenize(ids, special=True).decode("utf-8", errors="replace") for ids in req["ids"]]}
        elif cmd == "argmax":
            llm.reset()
            llm.eval(req["ids"])
            scores = llm.scores[: llm.n_tokens]  # [n, vocab]
            out = {"argmax": np.argmax(scores, axis=-1).tolist()}
        elif cmd == "generate":
            llm.reset()
            t0 = time.perf_counter()
            llm.eval(req["ids"])
            t1 = time.perf_counter()
            tokens = [last_argmax(llm)]
            while len(tokens) < req["max_tokens"]:
                llm.eval([tokens[-1]])
                tokens.append(last_argmax(llm))
            t2 = time.perf_counter()
            out = {"tokens": tokens, "prompt_s": t1 - t0, "decode_s": t2 - t1}
        elif cmd == "eog":
            vocab = llama_cpp.llama_model_get_vocab(llm.model)
            out = {"eog": [i for i in range(llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, i)]}
        elif cmd == "info":
            out = {"system_info": llama_print_system_info().decode(), "version": llama_cpp_version}
        else:
            out = {"error": f"unknown cmd {cmd!r}"}
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
