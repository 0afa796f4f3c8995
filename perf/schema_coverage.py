"""How many real-world JSON schemas structured outputs compile: JSONSchemaBench (guidance-ai/jsonschemabench,
~9,500 schemas from GitHub, Kubernetes, Snowplow, JSON Schema Store, ...) through the engine's own path
(``engine.structured_output.to_grammar``, which closes objects, then llguidance's matcher on the model's
tokenizer), beside plain llguidance on the schema as written.

The data is not part of this repository: check the benchmark out anywhere and point ``--data`` at its ``data/``
folder (one sub-folder per source, one schema per ``.json`` file).

    ORTSERVE_CACHE_DIR=.cache .venv/bin/python -m perf.schema_coverage --data /tmp/jsonschemabench/data \\
        --json docs/perf/schema_coverage.json

Run it from another checkout's venv (``/work/main/.venv/bin/python perf/schema_coverage.py ...``) to
measure that checkout's engine: the script imports ``engine`` from wherever the interpreter finds it.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import random
import re
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any


def load_schemas(data: Path, per_source: int | None, seed: int) -> list[tuple[str, str, str]]:
    """(source, file name, schema text) for every schema, or ``per_source`` of each source (seeded sample)."""
    out = []
    for folder in sorted(p for p in data.iterdir() if p.is_dir()):
        files = sorted(folder.glob("*.json"))
        if per_source is not None and len(files) > per_source:
            files = sorted(random.Random(f"{seed}:{folder.name}").sample(files, per_source))
        out += [(folder.name, f.name, f.read_text(encoding="utf-8", errors="replace")) for f in files]
    return out


def reason_of(error: str) -> str:
    """A short class of a compile error (the first clause, numbers and quoted names dropped)."""
    first = error.strip().splitlines()[0] if error.strip() else "error"
    first = re.sub(r"'[^']*'|\"[^\"]*\"", "X", first)
    first = re.sub(r"\d+", "N", first)
    return first[:90]


def main(argv: list[str] | None = None) -> int:
    import llguidance

    from engine.builder.pull import pull_model
    from engine.structured_output import JSON_OPTIONS, GrammarError, to_grammar
    from engine.tokenizer import Tokenizer

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, required=True, help="jsonschemabench's data/ folder")
    parser.add_argument("--per-source", type=int, default=None, help="a seeded sample of this many per source")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model-dir", type=Path, default=None, help="whose tokenizer (default: the default model)")
    parser.add_argument("--timeout-s", type=float, default=10.0, help="a compile slower than this counts as failed")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    model_dir = args.model_dir or pull_model(progress=False)
    hf = Tokenizer.from_file(model_dir / "tokenizer.json").hf
    tokenizer = llguidance.LLTokenizer(hf.to_str(), n_vocab=hf.get_vocab_size(with_added_tokens=True))
    limits = llguidance.LLParserLimits(verbose_errors=False)

    def compile_one(grammar_of: Any, text: str) -> str | None:
        """None when it compiles, else the error."""
        try:
            grammar = grammar_of(text)
        except (GrammarError, ValueError) as exc:
            return str(exc)
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=limits)
        return matcher.get_error() if matcher.is_error() else None

    def plain(text: str) -> str:
        return llguidance.LLMatcher.grammar_from_json_schema(json.loads(text), defaults=JSON_OPTIONS)

    routes = {"ortserve": lambda text: to_grammar("json_schema", text), "llguidance": plain}
    schemas = load_schemas(args.data, args.per_source, args.seed)
    print(f"{len(schemas)} schemas from {args.data}", file=sys.stderr)
    records: list[dict[str, Any]] = []
    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # LLMatcher releases the GIL while it builds
        for i, (source, name, text) in enumerate(schemas):
            record: dict[str, Any] = {"source": source, "file": name}
            for route, grammar_of in routes.items():
                future = pool.submit(compile_one, grammar_of, text)
                try:
                    error = future.result(timeout=args.timeout_s)
                except concurrent.futures.TimeoutError:
                    error = f"timeout: no compile within {args.timeout_s:g} s"
                except Exception as exc:  # the library's own failures count as refusals, named
                    error = f"{type(exc).__name__}: {exc}"
                record[route] = error
            records.append(record)
            if (i + 1) % 200 == 0:
                print(f"  {i + 1}/{len(schemas)} ({time.monotonic() - t0:.0f} s)", file=sys.stderr)

    def rate(rows: list[dict[str, Any]], route: str) -> float:
        return sum(r[route] is None for r in rows) / max(1, len(rows))

    by_source = {s: [r for r in records if r["source"] == s] for s in sorted({r["source"] for r in records})}
    summary = {
        "schemas": len(records),
        "compiled": {route: rate(records, route) for route in routes},
        "by_source": {s: {"schemas": len(rows), **{route: rate(rows, route) for route in routes}}
                      for s, rows in by_source.items()},
        "only_llguidance": sum(r["llguidance"] is None and r["ortserve"] is not None for r in records),
        "only_ortserve": sum(r["ortserve"] is None and r["llguidance"] is not None for r in records),
        "ortserve_refusals": Counter(reason_of(r["ortserve"]) for r in records
                                     if r["ortserve"] is not None).most_common(15),
    }
    print(json.dumps(summary, indent=1), file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, "records": records}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
