"""Prefill node: computes prompts' KV and first tokens, pushes the KV to decode nodes."""
