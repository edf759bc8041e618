"""Decode node: reserves KV blocks under a lease, receives the prompt's KV, decodes in continuous batches."""
