"""`ortserve bench --scenario multiturn|copy`: prefix reuse and speculative decoding as a client sees them,
each request interleaved with the same request to peer servers (the same server with a feature off), so the
ratios come from one run in which load that comes and goes hits every target alike.

multiturn: conversations over a long system prompt (unique per conversation), ``--turns`` turns each; every
    turn resends the whole conversation. Ratios: median TTFT of turns 2..N over turn 1's, and turn 1 (a cold
    request) against the peer. copy: "repeat this text" requests (answers copy their input) and free-text
    requests, greedy. Ratios: single-stream decode tok/s against the peer, and whether the texts agree.

The official openai streaming client, as users take it; no server or engine import.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import httpx
import openai

from bench.scenarios import index_words, make_prompt

FEATURE_SCENARIOS = ("multiturn", "copy")

# NOTE(bench): plain prose the model can repeat (copy) and open prompts (free text); written for this bench.
PASSAGES = (
    "The committee met on Tuesday to review the budget for the coming year. After a long discussion, the "
    "members agreed to increase funding for the public library by ten percent, to repair the roof of the "
    "community center before winter, and to hire two more teachers for the primary school. The mayor thanked "
    "everyone for their patience and promised to publish the full minutes on the town website by Friday.",
    "To replace a bicycle chain, first shift to the smallest rear sprocket so the chain is slack. Use a chain "
    "tool to push out one pin, remove the old chain, and count its links. Cut the new chain to the same "
    "length, thread it through the derailleurs, and join the ends with the connecting pin. Turn the pedals "
    "backwards a few times and check that every link moves freely.",
    "Our train left the station just after dawn. For the first hour we followed the river through flat "
    "farmland, where mist still lay over the fields and cows stood by the fences. Then the valley narrowed, "
    "the track began to climb, and the forest closed in on both sides. By noon we had reached the pass, and "
    "the whole range of snowy peaks opened up in front of us.",
    "The function reads the configuration file, checks that every required key is present, and returns a "
    "dictionary of settings. If a key is missing, it raises an error that names the key and the file. "
    "Values that look like numbers are converted to integers, and paths are made absolute relative to the "
    "directory of the file. The result is cached, so later calls return the same dictionary.",
    "Bread needs only four things: flour, water, salt and yeast. Mix them into a rough dough and let it rest "
    "for half an hour. Knead it until it feels smooth and springs back when pressed, then leave it covered "
    "in a warm place until it has doubled in size. Shape the loaf, let it rise again, and bake it in a hot "
    "oven until the crust is deep brown and the bottom sounds hollow.",
    "Thank you for your order. Your package was shipped this morning and should arrive within three working "
    "days. You can follow its progress with the tracking number in this message. If anything is missing or "
    "damaged, reply to this email with a photo and your order number, and we will send a replacement or "
    "refund the full price, whichever you prefer.",
    "Honeybees live in colonies of many thousands. A single queen lays the eggs, while the workers clean the "
    "hive, feed the young, build the wax comb and gather nectar and pollen from flowers. When a worker finds "
    "a good source of food, she returns to the hive and performs a dance that tells the others its direction "
    "and distance from the hive.",
    "The meeting is moved from Monday to Wednesday at ten in the morning, in the small room on the second "
    "floor. Please bring the sales figures for the last quarter and your plans for the spring campaign. "
    "Lunch will be served after the meeting. If you cannot attend, send your notes to the team by Tuesday "
    "evening so that we can discuss them without you.",
)
FREE_PROMPTS = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a refrigerator keeps food cold, in simple words.",
    "Describe your ideal weekend in the mountains.",
    "Write a letter to a friend about learning to play the guitar.",
    "What are some good habits for staying healthy? Explain each one.",
    "Tell a story about a robot who wants to become a painter.",
    "Describe a busy market in a small town on a Saturday morning.",
    "Explain why the sky is blue to a ten year old.",
)
COPY_INSTRUCTION = "Repeat the following text exactly, word for word, without any changes:\n\n"


@dataclass
class Reply:
    """One streamed request as the client saw it; times in seconds from the send."""

    target: str
    kind: str  # multiturn: "turn"; copy: "copy" or "free"
    index: int  # conversation (multiturn) or request (copy)
    turn: int = 1
    ttft_s: float | None = None
    e2e_s: float | None = None
    num_prompt_tokens: int | None = None
    num_cached_tokens: int | None = None
    num_completion_tokens: int | None = None
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None

    @property
    def decode_tokens_per_s(self) -> float | None:
        """1 / time per output token after the first (the server's token count, not the chunks)."""
        n = self.num_completion_tokens or 0
        if self.ttft_s is None or self.e2e_s is None or n < 2 or self.e2e_s <= self.ttft_s:
            return None
        return (n - 1) / (self.e2e_s - self.ttft_s)


class Target:
    """One server: ``name`` in reports, its OpenAI base URL."""

    def __init__(self, name: str, url: str, api_key: str, timeout_s: float) -> None:
        self.name = name
        self.url = url
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0))
        self.client = openai.AsyncOpenAI(base_url=url, api_key=api_key, max_retries=0, http_client=self._http)
        self.model: str | None = None

    async def prepare(self) -> None:
        models = await self.client.models.list()
        if not models.data:
            raise RuntimeError(f"{self.url}/models lists no model")
        self.model = models.data[0].id

    async def chat(self, reply: Reply, messages: list[dict], max_tokens: int, ignore_eos: bool) -> Reply:
        """Stream one greedy chat completion into ``reply`` (errors are recorded, never raised)."""
        t0 = time.perf_counter()
        parts: list[str] = []
        try:
            stream = await self.client.chat.completions.create(
                model=self.model, messages=messages, max_tokens=max_tokens, temperature=0.0, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": ignore_eos})
            async for chunk in stream:
                if chunk.usage is not None:
                    reply.num_prompt_tokens = chunk.usage.prompt_tokens
                    reply.num_completion_tokens = chunk.usage.completion_tokens
                    details = getattr(chunk.usage, "prompt_tokens_details", None)
                    reply.num_cached_tokens = getattr(details, "cached_tokens", None)
                for choice in chunk.choices:
                    if choice.delta.content:
                        if reply.ttft_s is None:
                            reply.ttft_s = time.perf_counter() - t0
                        parts.append(choice.delta.content)
                    if choice.finish_reason is not None:
                        reply.finish_reason = choice.finish_reason
        except Exception as exc:  # noqa: BLE001 - a failed request is a figure
            reply.error = f"{type(exc).__name__}: {exc}"[:300]
        reply.e2e_s = time.perf_counter() - t0
        reply.text = "".join(parts)
        return reply

    async def aclose(self) -> None:
        await self.client.close()
        await self._http.aclose()


def _rotated(targets: list[Target], k: int) -> list[Target]:
    k %= len(targets)
    return targets[k:] + targets[:k]


async def run_multiturn(targets: list[Target], *, conversations: int, turns: int, system_tokens: int,
                        user_tokens: int, output_tokens: int, seed: int, pause_s: float,
                        progress: bool = False, distinct_prompts: bool = False) -> list[Reply]:
    """Each conversation runs turn by turn on every target in turn (order rotating); each target keeps its own
    history (its own answers), as separate users would. ``distinct_prompts``: every target gets its own system
    prompts, for targets that front the same servers (two routers over one set of replicas), whose caches
    would otherwise serve one target's turns from the other's."""
    rng = random.Random(seed)
    replies: list[Reply] = []
    for c in range(conversations):
        # NOTE(bench): the conversation number, spelled in words, leads: no two system prompts share a prefix
        # beyond the chat template's first tokens, so every turn 1 is a cold request.
        if distinct_prompts:
            n = len(targets)
            history = {t.name: [{"role": "system", "content": make_prompt(
                system_tokens, rng, prefix_words=index_words(c * n + k))}] for k, t in enumerate(targets)}
        else:
            system = make_prompt(system_tokens, rng, prefix_words=index_words(c))
            history = {t.name: [{"role": "system", "content": system}] for t in targets}
        for turn in range(1, turns + 1):
            user = make_prompt(user_tokens, rng)
            for target in _rotated(targets, c + turn):
                messages = history[target.name] + [{"role": "user", "content": user}]
                reply = await target.chat(Reply(target.name, "turn", c, turn), messages, output_tokens, True)
                replies.append(reply)
                history[target.name] = messages + [{"role": "assistant", "content": reply.text}]
                await asyncio.sleep(pause_s)  # let the previous server's spinning threads go idle
        if progress:
            print(f"[bench] multiturn: conversation {c + 1}/{conversations} done", file=sys.stderr, flush=True)
    return replies


async def run_copy(targets: list[Target], *, requests: int, output_tokens: int, pause_s: float,
                   progress: bool = False) -> list[Reply]:
    """Copy and free-text requests, alternating, each sent to every target in turn (order rotating)."""
    replies: list[Reply] = []
    for i in range(requests):
        for kind, prompt in (("copy", COPY_INSTRUCTION + PASSAGES[i % len(PASSAGES)]),
                             ("free", FREE_PROMPTS[i % len(FREE_PROMPTS)])):
            for target in _rotated(targets, i):
                replies.append(await target.chat(Reply(target.name, kind, i), [{"role": "user", "content": prompt}],
                                                 output_tokens, False))
                await asyncio.sleep(pause_s)
        if progress:
            print(f"[bench] copy: request {i + 1}/{requests} done", file=sys.stderr, flush=True)
    return replies


def _median(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def summarize_multiturn(replies: list[Reply], names: list[str], turns: int) -> dict:
    """Per target: median TTFT per turn, turns 2..N over turn 1; against each peer: turn 1's speed ratio."""
    out: dict = {"targets": {}}
    for name in names:
        mine = [r for r in replies if r.target == name and r.error is None]
        per_turn = {t: _median([r.ttft_s for r in mine if r.turn == t]) for t in range(1, turns + 1)}
        later = _median([r.ttft_s for r in mine if r.turn > 1])
        out["targets"][name] = {
            "ttft_p50_s_by_turn": per_turn, "ttft_p50_s_turn1": per_turn[1], "ttft_p50_s_later_turns": later,
            "later_over_turn1": _ratio(later, per_turn[1]),
            "cached_tokens_p50_by_turn": {t: _median([r.num_cached_tokens for r in mine if r.turn == t])
                                          for t in range(1, turns + 1)},
            "prompt_tokens_p50_by_turn": {t: _median([r.num_prompt_tokens for r in mine if r.turn == t])
                                          for t in range(1, turns + 1)},
            "errors": sum(r.error is not None for r in replies if r.target == name)}
    first = names[0]
    for peer in names[1:]:
        # cold requests: turn 1 of each conversation, peer TTFT over ours (> 1: we are faster), paired
        pairs = [_ratio(_ttft(replies, peer, c, 1), _ttft(replies, first, c, 1))
                 for c in sorted({r.index for r in replies})]
        out["targets"][peer]["cold_speed_ratio"] = {"median": _median(pairs), "per_conversation": pairs}
    return out


def _ttft(replies: list[Reply], name: str, index: int, turn: int) -> float | None:
    return next((r.ttft_s for r in replies if (r.target, r.index, r.turn) == (name, index, turn)), None)


def summarize_copy(replies: list[Reply], names: list[str]) -> dict:
    """Per target and kind: median decode tok/s; against each peer: paired speed ratios and equal texts."""
    out: dict = {"targets": {}}
    for name in names:
        mine = [r for r in replies if r.target == name and r.error is None]
        out["targets"][name] = {kind: {"decode_tok_s_p50": _median([r.decode_tokens_per_s for r in mine
                                                                     if r.kind == kind]),
                                       "completion_tokens_p50": _median([r.num_completion_tokens for r in mine
                                                                         if r.kind == kind])}
                                for kind in ("copy", "free")}
        out["targets"][name]["errors"] = sum(r.error is not None for r in replies if r.target == name)
    first = names[0]
    ours = {(r.kind, r.index): r for r in replies if r.target == first}
    for peer in names[1:]:
        theirs = {(r.kind, r.index): r for r in replies if r.target == peer}
        for kind in ("copy", "free"):
            keys = sorted(k for k in ours if k[0] == kind and k in theirs)
            ratios = [_ratio(ours[k].decode_tokens_per_s, theirs[k].decode_tokens_per_s) for k in keys]
            same = [ours[k].text == theirs[k].text for k in keys]
            out["targets"][peer][kind].update({"speed_ratio": {"median": _median(ratios), "per_request": ratios},
                                               "same_text": sum(same), "compared": len(same)})
    return out


def format_summary(scenario: str, summary: dict, names: list[str]) -> str:
    """The lines `ortserve bench` prints: each figure and the ratio the issue asks for."""
    lines = []
    t = summary["targets"]
    first = names[0]
    if scenario == "multiturn":
        for name in names:
            s = t[name]
            lines.append(f"multiturn {name}: TTFT p50 turn 1 {_ms(s['ttft_p50_s_turn1'])}, later turns "
                         f"{_ms(s['ttft_p50_s_later_turns'])}: {_x(s['later_over_turn1'])} of turn 1 "
                         f"(prefix reuse target <= 0.25x); cached tokens p50 by turn "
                         f"{list(s['cached_tokens_p50_by_turn'].values())}")
        for peer in names[1:]:
            lines.append(f"multiturn cold request (turn 1) TTFT, {first} vs {peer}: speed "
                         f"{_x(t[peer]['cold_speed_ratio']['median'])} (target >= 0.98x)")
    else:
        for name in names:
            lines.append(f"copy {name}: decode tok/s p50 copy {_num(t[name]['copy']['decode_tok_s_p50'])}, "
                         f"free text {_num(t[name]['free']['decode_tok_s_p50'])}")
        for peer in names[1:]:
            for kind, target in (("copy", ">= 1.5x"), ("free", ">= 0.97x")):
                s = t[peer][kind]
                lines.append(f"{kind} {first} vs {peer}: decode speed {_x(s['speed_ratio']['median'])} (target "
                             f"{target}); same greedy text {s['same_text']}/{s['compared']}")
    return "\n".join(lines)


def _ms(s: float | None) -> str:
    return "n/a" if s is None else f"{s * 1e3:.0f} ms"


def _x(r: float | None) -> str:
    return "n/a" if r is None else f"{r:.2f}x"


def _num(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.1f}"


async def run(args) -> dict:
    """The scenario of ``args`` (bench/cli.py's namespace) against --url and every --peer-url; the report."""
    labels = args.peer_label or []
    urls = [(args.label or "ortserve", args.url)] + [
        (labels[i] if i < len(labels) else f"peer{i + 1}", url) for i, url in enumerate(args.peer_url or [])]
    targets = [Target(name, url, args.api_key, args.request_timeout) for name, url in urls]
    try:
        for target in targets:
            await target.prepare()
        warm = [{"role": "user", "content": "Say hello."}]
        for target in targets:  # compile kernels, fill caches of the session: unrecorded
            await target.chat(Reply(target.name, "warmup", -1), warm, 8, True)
        names = [t.name for t in targets]
        if args.scenario == "multiturn":
            replies = await run_multiturn(targets, conversations=args.num_requests or 6, turns=args.turns,
                                          system_tokens=args.system_tokens, user_tokens=args.user_tokens,
                                          output_tokens=args.output_tokens, seed=args.seed, pause_s=args.pause,
                                          progress=bool(args.progress),
                                          distinct_prompts=getattr(args, "distinct_prompts", False))
            summary = summarize_multiturn(replies, names, args.turns)
        else:
            replies = await run_copy(targets, requests=args.num_requests or len(PASSAGES),
                                     output_tokens=args.output_tokens, pause_s=args.pause,
                                     progress=bool(args.progress))
            summary = summarize_copy(replies, names)
    finally:
        for target in targets:
            await target.aclose()
    from bench.report import git_revision, machine_info

    settings = {k: v for k, v in vars(args).items() if k not in ("api_key", "compare", "progress")}
    return {"schema": "ortserve-bench-features/1", "scenario": args.scenario, "git": git_revision(),
            "machine": machine_info(), "settings": settings, "targets": [{"name": n, "url": u} for n, u in urls],
            "summary": summary, "replies": [asdict(r) for r in replies]}
