"""Operational routes: /health, /metrics and the chat page (the wire protocols have their own packages)."""
