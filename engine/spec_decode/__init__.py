"""Speculative decoding: the proposal sources (prompt lookup, a draft model) behind one interface, the rejection step
that keeps the target's distribution, and the vocabulary check of a target/draft pair (as vLLM's v1/spec_decode/).

``engine.scheduler`` decides which rows speculate, with which source and how many tokens; ``engine.core`` runs the
draft model (``draft_model.DraftModelProposer``) and the target's checks; ``engine.sampler.RequestSampler.verify``
accepts tokens (``rejection``).
"""
