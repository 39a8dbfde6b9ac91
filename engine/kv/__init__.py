"""KV beyond one engine's page pool: block keys, the connector seam, block payloads and the host tier
(docs/kv-tiers.md). No Django."""
