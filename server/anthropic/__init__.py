"""Anthropic's Messages API: wire models, route and event generator (errors in Anthropic's shape)."""
