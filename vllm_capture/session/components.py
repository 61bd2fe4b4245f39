"""Capture stream names.

The values travel in RPC payloads and status dicts, so they are plain
strings that the client and the worker must spell identically.
"""

HIDDEN_STATES = "hidden_states"
ATTENTION_HEADS = "attention_heads"
ROUTER_LOGITS = "router_logits"

COMPONENTS = (HIDDEN_STATES, ATTENTION_HEADS, ROUTER_LOGITS)

# Identical on every tensor-parallel rank (attention heads are sharded by head instead).
REPLICATED_COMPONENTS = (HIDDEN_STATES, ROUTER_LOGITS)
