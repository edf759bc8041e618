"""The engine core: requests, block pool, KV cache manager, scheduler, models, model runner,
sampler, ``LLMEngine`` and the offline ``LLM`` API.

It imports nothing above it (no node, proxy, CLI or benchmark module); node services reach it
only through ``LLMEngine``'s public methods. Importing this package loads nothing: import the
module you need.
"""
