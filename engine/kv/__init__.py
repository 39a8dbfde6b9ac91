"""KV beyond one engine's page pool: the connector seam, block payloads, leases, transport and the host tier
(docs/kv-tiers.md). Blocks are named by engine/block_keys.py's keys. No Django."""
