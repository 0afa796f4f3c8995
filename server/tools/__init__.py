"""Tool calling: the request plan (format, prompt, grammar), the output parsers and the streamed deltas.

Imports engine.types only from the engine; the grammar library stays inside the engine.
"""
