"""The most a draft model can give on this machine: speculative decoding's ceiling from measured parts (issue 48).

No engine, no HTTP: the target's and the draft's graphs on the engine's own session options (perf.ceiling.BareLoop),
and the bench's own prompts (bench.speculative). Per workload:

1. the target's greedy answer (``--tokens``), then the draft model teacher-forced over prompt + answer in one run:
   at each answer position, whether the draft's argmax is the target's token, and so the run of agreeing tokens from
   there (what a draft started there would get kept under greedy);
2. the costs, in target decode steps, timed in interleaved single runs (medians): a draft decode step, a draft run
   of 2 tokens (the catch-up after a check kept whole), and a target check of S tokens;
3. the decode speed-up over the answer, replayed cycle by cycle from the agreement runs, for each fixed draft length
   k and for an oracle that knows the run that will be kept and drafts the part of it that pays most (it never
   drafts a token that is thrown away and never misses a draft that would pay: no length policy does better with
   this draft model), and for drafts that go on while the draft model is sure of its next token (``--draft-p-min``). Nothing else is charged (no
   sampling, no Python, no scheduling), so every figure is a ceiling for the engine.

    ORTSERVE_CACHE_DIR=.cache flock /work/locks/cpu-bench.lock .venv/bin/python -m perf.spec_bound \\
        --json docs/perf/spec-bound-cpu.json

Findings: docs/perf/speculative.md ("The ceiling").
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

MAX_DRAFT = 8
P_MINS = (0.3, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95)


def prompt_ids(folder: Path, workload: str, i: int) -> list[int]:
    """The bench's i-th request of ``workload``, rendered by the model's chat template and tokenized."""
    from tokenizers import Tokenizer

    from bench.speculative import messages_of
    from engine.chat_template import ChatTemplate

    template = ChatTemplate.from_tokenizer_config(json.loads((folder / "tokenizer_config.json").read_text()))
    text = template.render(messages_of(workload, i))
    return Tokenizer.from_file(str(folder / "tokenizer.json")).encode(text, add_special_tokens=False).ids


def greedy_answer(loop: Any, prompt: list[int], tokens: int, stop: set[int]) -> list[int]:
    """The target's greedy answer after ``prompt`` (at most ``tokens``, ending at a stop token)."""
    first = loop.prefill(prompt)
    out = [int(first[0])]
    loop.begin(first, len(prompt))
    while len(out) < tokens and out[-1] not in stop:
        out.append(int(loop.step()[0]))
    return out


def agreement_runs(agree: list[bool]) -> list[int]:
    """For each position, how many positions from there on agree in a row."""
    runs = [0] * (len(agree) + 1)
    for j in range(len(agree) - 1, -1, -1):
        runs[j] = runs[j + 1] + 1 if agree[j] else 0
    return runs[:-1]


def replay(runs: list[int], cost: dict[str, Any], k: int | None) -> float:
    """Decode speed-up over plain steps of a greedy answer whose agreement runs are ``runs``: each cycle drafts ``k``
    tokens (None: the oracle, which knows the run and drafts the length of it that gives the most tokens per step;
    0 drafted: a plain step), the target checks them in one run
    and keeps the agreeing prefix plus its own next token."""
    c, c2, check = cost["draft_step"], cost["draft_run2"], cost["check"]
    j, steps = 0, 0.0
    caught_up = True  # the draft row lacks at most the one token the target chose after the last check
    while j < len(runs):
        first = c if caught_up else c2
        if k is None:  # the oracle: of the lengths the run allows, the most tokens per step this cycle (0: none)
            d = max(range(min(runs[j], MAX_DRAFT, len(runs) - j - 1) + 1),
                    key=lambda n: 1.0 if n == 0 else (n + 1) / (first + c * (n - 1) + check[n + 1]))
        else:
            d = min(k, len(runs) - j - 1)
        if d <= 0:
            steps += 1.0
            j += 1
            caught_up = False
            continue
        kept = min(d, runs[j])
        # the draft's first run takes the token(s) it lacks (2 after a check kept whole), then one token a run
        steps += first + c * (d - 1) + check[d + 1]
        caught_up = kept < d  # a check kept whole leaves the draft row two tokens behind
        j += kept + 1
    return len(runs) / steps


def replay_gated(runs: list[int], cost: dict[str, Any], length: Any) -> float:
    """Like ``replay`` for a policy whose draft length ``length(j, room)`` reads the draft's confidence at answer
    position ``j`` (at least 1, at most ``room``): each cycle drafts that many tokens, the target keeps the agreeing
    prefix and adds its own; the last token is a plain step."""
    c, c2, check = cost["draft_step"], cost["draft_run2"], cost["check"]
    j, steps, caught_up = 0, 0.0, True
    while j < len(runs) - 1:
        d = length(j, min(MAX_DRAFT, len(runs) - j - 1))
        kept = min(d, runs[j])
        steps += (c if caught_up else c2) + c * (d - 1) + check[d + 1]
        caught_up = kept < d
        j += kept + 1
    steps += len(runs) - j  # the last token: a plain step
    return len(runs) / steps


def replay_confident(runs: list[int], conf: list[float], cost: dict[str, Any], p_min: float) -> float:
    """``replay_gated`` for a policy that reads the draft's own confidence: each cycle drafts one token, and more while
    the draft model gives its next token at least ``p_min`` (llama.cpp's --draft-p-min), at most MAX_DRAFT."""
    def length(j: int, room: int) -> int:
        d = 1
        while d < room and conf[j + d] >= p_min:
            d += 1
        return d

    return replay_gated(runs, cost, length)


def replay_cumulative(runs: list[int], conf: list[float], cost: dict[str, Any], tau: float | None,
                      accept: Any = None) -> float:
    """``replay_gated`` for a policy that reads the draft's confidence over the whole draft so far: each cycle drafts
    one token, and more while the product of the draft's probabilities of its tokens (its estimate that the target
    keeps the whole draft) stays at least ``tau``. ``accept``: a map from the draft's probability of a token to how
    often the target keeps it (a calibration; None: the probability itself). With ``tau`` None the rule is the
    expected gain: one more token while the chance that it is kept with all before it pays for its draft run and the
    check's extra row (``cost``)."""
    a = accept or (lambda p: p)
    c, check = cost["draft_step"], cost["check"]

    def length(j: int, room: int) -> int:
        d, kept_all = 1, a(conf[j])
        while d < room:
            nxt = kept_all * a(conf[j + d])
            if nxt < (tau if tau is not None else c + check[d + 2] - check[d + 1]):
                break
            d, kept_all = d + 1, nxt
        return d

    return replay_gated(runs, cost, length)


def calibration(agrees: list[list[bool]], confs: list[list[float]], bins: int = 10) -> Any:
    """How often the draft's argmax is the target's token, by the draft's probability of it (``bins`` equal bins
    of [0, 1]; a bin with no position takes its middle)."""
    edges = np.linspace(0.0, 1.0, bins + 1)
    flat_c = np.array([v for q in confs for v in q])
    flat_a = np.array([v for g in agrees for v in g], dtype=float)
    where = np.clip(np.digitize(flat_c, edges) - 1, 0, bins - 1)
    rate = [float(flat_a[where == b].mean()) if (where == b).any() else float((edges[b] + edges[b + 1]) / 2)
            for b in range(bins)]
    return lambda p: rate[min(int(p * bins), bins - 1)]


TAUS = (0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8)


def timed(fn: Any) -> float:
    """Seconds one call of ``fn`` takes."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--workloads", default="code_edit,chat,json")
    ap.add_argument("--prompts", type=int, default=4, help="prompts per workload (the bench's first N)")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=30, help="timed runs per cost (medians)")
    ap.add_argument("--spinning", action="store_true",
                    help="the sessions' threads spin on after each run (the engine before stop_spinning)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)

    from engine.builder.pull import resolve_model
    from perf.ceiling import BareLoop
    from perf.spec_cost import check_costs

    target_dir, draft_dir = resolve_model(args.target), resolve_model(args.draft)
    length = 1024
    # both with the engine's settings beside a draft model (EngineConfig.stop_spinning: neither pool spins on)
    stop = None if args.spinning else True
    tl = BareLoop(target_dir, 1, args.threads, length, stop_spinning=stop)
    dl = BareLoop(draft_dir, 1, args.threads, length, stop_spinning=stop)
    tok = json.loads((target_dir / "genai_config.json").read_text())["model"]
    eos = {int(t) for t in np.atleast_1d(tok.get("eos_token_id", []))}

    print("[spec_bound] costs (interleaved single runs, medians)", file=sys.stderr, flush=True)
    prompt = prompt_ids(target_dir, "chat", 0)
    tl.begin(tl.prefill(prompt), len(prompt))
    dl.begin(dl.prefill(prompt), len(prompt))
    t_step, d_step = [], []
    for _ in range(args.rounds):
        t_step.append(timed(tl.step))
        d_step.append(timed(dl.step))
    step = statistics.median(t_step)
    check = check_costs(target_dir, list(range(2, MAX_DRAFT + 2)), args.threads, args.rounds, position=len(prompt),
                        stop_spinning=stop)
    draft_checks = check_costs(draft_dir, [2], args.threads, args.rounds, position=len(prompt), stop_spinning=stop)
    cost = {"target_step_ms": round(1000 * step, 2), "draft_step_ms": round(1000 * statistics.median(d_step), 2),
            "draft_step": statistics.median(d_step) / step}
    cost["draft_run2"] = cost["draft_step"] * draft_checks[2]
    cost["check"] = {s: round(v, 3) for s, v in check.items()}

    report: dict[str, Any] = {"target": str(target_dir), "draft": str(draft_dir), "tokens": args.tokens,
                              "threads": args.threads, "spinning": args.spinning, "costs": {k: (round(v, 3) if isinstance(v, float) else v)
                                                                 for k, v in cost.items()}, "workloads": {}}
    for workload in args.workloads.split(","):
        runs_all: list[list[int]] = []
        confs: list[list[float]] = []
        agrees: list[list[bool]] = []
        agreed = total = 0
        for i in range(args.prompts):
            prompt = prompt_ids(target_dir, workload, i)
            answer = greedy_answer(tl, prompt, args.tokens, eos)
            # the draft's logits before each answer token
            z = dl.prompt_logits(prompt + answer, keep_all=True)[len(prompt) - 1:len(prompt) + len(answer) - 1]
            agree = [int(g) == a for g, a in zip(np.argmax(z, axis=-1), answer)]
            z = np.exp(z - z.max(axis=-1, keepdims=True))
            confs.append([float(v) for v in (z.max(axis=-1) / z.sum(axis=-1))])
            agreed, total = agreed + sum(agree), total + len(agree)
            agrees.append(agree)
            runs_all.append(agreement_runs(agree))
        ks = {str(k): round(statistics.mean(replay(r, cost, k) for r in runs_all), 3) for k in range(1, MAX_DRAFT + 1)}
        oracle = round(statistics.mean(replay(r, cost, None) for r in runs_all), 3)
        gated = {str(p): round(statistics.mean(replay_confident(r, q, cost, p) for r, q in zip(runs_all, confs)), 3)
                 for p in P_MINS}
        cumulative = {str(t): round(statistics.mean(replay_cumulative(r, q, cost, t) for r, q in zip(runs_all, confs)),
                                    3) for t in TAUS}
        accept = calibration(agrees, confs)
        expected = round(statistics.mean(replay_cumulative(r, q, cost, None, accept) for r, q in zip(runs_all, confs)),
                         3)
        best = max(ks, key=ks.get)
        best_p = max(gated, key=gated.get)
        best_t = max(cumulative, key=cumulative.get)
        report["workloads"][workload] = {"agreement": round(agreed / total, 3), "tokens": total,
                                         "speedup_by_draft_length": ks, "best_fixed": [int(best), ks[best]],
                                         "oracle": oracle, "speedup_by_p_min": gated,
                                         "best_p_min": [float(best_p), gated[best_p]],
                                         "speedup_by_product": cumulative, "best_product": [float(best_t),
                                                                                            cumulative[best_t]],
                                         "expected_gain_calibrated": expected,
                                         "calibration": [round(accept((b + 0.5) / 10), 3) for b in range(10)],
                                         "positions": {"agree": [[int(v) for v in g] for g in agrees],
                                                       "p": [[round(v, 4) for v in q] for q in confs]}}
        print(f"[spec_bound] {workload}: agreement {agreed / total:.1%} over {total} tokens; ceiling: best fixed "
              f"k={best} {ks[best]:.2f}x, by the draft's confidence (p_min {best_p}) {gated[best_p]:.2f}x, "
              f"by the product of its probabilities (tau {best_t}) {cumulative[best_t]:.2f}x, expected gain "
              f"(calibrated) {expected:.2f}x, oracle {oracle:.2f}x", file=sys.stderr, flush=True)
    if not args.json:
        print(json.dumps(report, indent=1))
    else:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
