"""Ollama's native API (/api/*): its wire models, routes and NDJSON streams over the engine run."""
