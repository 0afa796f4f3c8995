"""Decisions: OpenAI's POST /v1/decisions and System One's POST /v1/systemone, answered by reading the label tokens'
log-probabilities at the answer position instead of generating (wire models, route, converter to engine reads).
"""
