"""Rerank and score: POST /v1/rerank (/rerank, /v2/rerank; Jina's, Cohere's and TEI's shapes) and vLLM's POST /v1/score,
on an embedding model (cosine) or the chat model (the probability of "yes"): wire models and route.
"""
