"""OpenAI's Chat Completions, Completions and Models APIs: wire models, routes and event generators."""
