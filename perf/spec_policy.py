"""The draft model's length policy replayed over measured answers: what the engine's own ``ModelDraftState`` (when a
row drafts, how long) gives on the bench's workloads, against drafting every step (issue 48).

Reads a ``perf.spec_bound --json`` report (its costs, and per position of each greedy answer whether the draft's
argmax was the target's token and the draft's probability of it) and replays each answer cycle by cycle as the engine
runs it: ``ModelDraftState.plan`` says how many tokens to draft, the draft stops early after a token it gave less
than ``--spec-draft-p-min`` (the token is kept in the draft, as ``DraftModelProposer`` does), the target keeps the
agreeing prefix and adds its own token, and ``record`` learns from it. Costs in decode steps as spec_bound measured
them: a draft's first token its 2-token catch-up, later ones a draft step each, a check of d tokens ``check[d + 1]``,
a row resuming after plain steps ``--resume-step`` a token more. Nothing else is charged (no sampling, no Python),
so the figures are the policy's ceiling; the bench (``bench --scenario speculative``) says what the engine gets.

Also replays texts whose drafts never pay (a fixed agreement and probability), where the policy must keep the row at
about the speed of plain steps (the issue's 0.95x floor).

    .venv/bin/python -m perf.spec_policy docs/perf/spec-bound-cpu-positions.json

Findings: docs/perf/speculative.md ("The length policy replayed").
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path
from typing import Any

from engine.spec_decode.policy import ModelDraftState
from perf.spec_bound import agreement_runs

MAX_DRAFT = 8
P_MINS = (0.6, 0.75, 0.8)


class ReplayCost:
    """A ``CheckCost`` stand-in with spec_bound's measured costs (decode steps)."""

    def __init__(self, costs: dict[str, Any], resume_step: float) -> None:
        self.c, self.c2 = costs["draft_step"], costs["draft_run2"]
        self.check = {int(k): v for k, v in costs["check"].items()}
        self.resume_step = resume_step

    def draft_steps(self, num_tokens: int) -> float:
        return 0.0 if num_tokens <= 0 else self.c2 + self.c * (num_tokens - 1)

    def steps(self, num_draft: int) -> float:
        return self.check[min(num_draft + 1, max(self.check))] if num_draft else 1.0

    def resume_steps(self, num_tokens: int) -> float:
        return 0.0 if num_tokens <= 2 else self.resume_step * (num_tokens - 2)


def replay_policy(runs: list[int], probs: list[float], cost: ReplayCost, p_min: float, every_step: bool = False,
                  prompt_tokens: int = 30) -> float:
    """Decode speed-up over plain steps of one answer under the engine's policy (``every_step``: a draft of up to
    MAX_DRAFT tokens every step instead, stopped by ``p_min`` alone)."""
    state = ModelDraftState()
    j, steps, n = 0, 0.0, len(runs)
    while j < n - 1:
        if every_step:
            num, resume = min(MAX_DRAFT, n - j - 1), 0.0
        else:
            num, _ = state.plan(min(MAX_DRAFT, n - j - 1), cost, prompt_tokens + j, n - j)
            resume = 0.0 if state.drafted_last else cost.resume_steps(prompt_tokens + j - state.drafted_at)
        if not num:
            state.drafted_last = False
            steps, j = steps + 1.0, j + 1
            continue
        state.drafted_last, state.drafted_at = True, prompt_tokens + j
        d = 1
        while d < num and probs[j + d - 1] >= p_min:  # the draft's d-th token was sure enough to go on after it
            d += 1
        kept = min(d, runs[j])
        steps += cost.draft_steps(d) + cost.steps(d) + resume
        state.record(d, kept)
        j += kept + 1
    steps += n - j  # the last token: a plain step
    return n / steps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bound", type=Path, help="perf.spec_bound --json report (with positions)")
    ap.add_argument("--resume-step", type=float, default=0.06,
                    help="decode steps per token of a draft row's catch-up after plain steps (the draft's prefill per "
                         "token: ~0.06 on the 2-core CPU)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    bound = json.loads(args.bound.read_text())
    cost = ReplayCost(bound["costs"], args.resume_step)
    report: dict[str, Any] = {"bound": str(args.bound), "resume_step": args.resume_step, "workloads": {}, "floor": {}}
    for workload, entry in bound["workloads"].items():
        positions = entry["positions"]
        answers = [(agreement_runs([bool(v) for v in agree]), probs)
                   for agree, probs in zip(positions["agree"], positions["p"])]
        row = {}
        for p_min in P_MINS:
            row[str(p_min)] = {
                "policy": round(statistics.mean(replay_policy(r, q, cost, p_min) for r, q in answers), 3),
                "every_step": round(statistics.mean(replay_policy(r, q, cost, p_min, every_step=True)
                                                    for r, q in answers), 3)}
        report["workloads"][workload] = row
        print(f"[spec_policy] {workload}: " + ", ".join(
            f"p_min {p}: policy {v['policy']:.3f}x, every step {v['every_step']:.3f}x" for p, v in row.items()),
            file=sys.stderr)
    rng = random.Random(0)
    for prob in (0.5, 0.9):
        for agreement in (0.0, 0.3):
            agree = [rng.random() < agreement for _ in range(512)]
            runs = agreement_runs(agree)
            key = f"agreement {agreement}, p {prob}"
            report["floor"][key] = {str(p): round(replay_policy(runs, [prob] * 512, cost, p), 3) for p in P_MINS}
            print(f"[spec_policy] a text whose drafts do not pay ({key}): {report['floor'][key]}", file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    else:
        print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
