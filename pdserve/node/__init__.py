"""The node framework every role shares: engine start-up, services, the engine loop that
streams outputs, prefix-index publishing, admission, drain, internal HTTP plumbing.

The roles (``pdserve.prefill_node``, ``pdserve.decode_node``) build on it.
"""
