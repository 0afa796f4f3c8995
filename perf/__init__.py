"""One-off performance investigations (ceilings, overheads, peer comparisons, GPU probes), apart from the
load-test harness in bench/. docs/perf/README.md says what each one measured and how to run it again.

May import the engine's internals, onnxruntime, onnxruntime_genai and matplotlib; nothing in bench/,
server/ or engine/ imports perf.
"""
