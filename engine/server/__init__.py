"""The engine's internal HTTP API, served by `python -m engine`. Every call needs
`Authorization: Bearer $QUILT_ENGINE_TOKEN` (401 otherwise). Errors are
`{"error": {"type", "message", "param", "code"?}}` with 400 (bad request, before anything is scheduled; code
"context_length_exceeded" for a prompt past the context),
404, 409 (conflicts with running work) or 503 (shutting down; or, type "adapter_unavailable" with param
"adapter", when the request's adapter cannot be loaded: that request alone fails, health stays ok).

POST /v1/generate            {request_id?, tenant?, weight?, api_key_id?, metadata?,
                              adapter?: digest | {digest, path?},
                              prompt | prompt_token_ids | messages, sampling?: {SamplingParams fields}, stream?,
                              context_overflow?: "cap" | "refuse",
                              kv_transfer?: {mode: "prefill", lease_ttl_s?} | {mode: "decode", lease: {...}}}
                             a batch: prompt as a list of strings or prompt_token_ids as a list of lists, each
                             prompt with n completions indexed prompt * n + i; "refuse": a prompt plus max_tokens past
                             the context is a 400 "context_length_exceeded" ("cap", the default: it ends at the context)
                             stream (default): NDJSON delta events then one final event (see events.py);
                             stream=false: the final event alone.
                             kv_transfer (disaggregated serving, docs/kv-tiers.md): "prefill" (stream false) answers
                             {kv_lease, usage: {prompt_tokens, cached_tokens, gpu_seconds}}; "decode" pulls the lease's
                             blocks first (recomputing what it cannot) and its usage gains kv_transfer.
POST /v1/abort/{request_id}  {request_id, aborted: true} | 404 (during a decode hop's KV pull too)
POST /v1/tokenize            {prompt | prompt_token_ids | messages} -> {count, token_ids, max_model_len}
POST /v1/adapters/prefetch   {digest, path?, tier?: "host" | "gpu"} -> {digest, resident: [tiers]}
DELETE /v1/adapters/{digest} -> {digest, evicted: [tiers]} | 404 unknown | 409 in use
GET /v1/health               {status: ok | draining | unhealthy, model, device, max_model_len} (503 unless ok)
GET /v1/state                engine.contract.StateAnswer: the EngineState each heartbeat carries (role, capacity,
                             running/waiting, pages (KV blocks and adapter pages share them; kv_pool, the pool's own
                             counts), memory split {base_weights, kv_pages, adapter_pages, free}_bytes and the
                             quantization report (docs/quantization.md), prefix-cache hit rate, adapters per tier
                             ("gpu" is the device tier, also on CPU) with residency, pins and load times, recent
                             prompt fingerprints), then the requests running and waiting, steps per second, the last
                             step's batch, kv_tiers, kv_leases, kv_pulls_in_flight, speculation, grammars
GET /metrics                 Prometheus text format

An adapter without `path` is looked for in `--adapter-store/<digest>`. Each request's end (finished,
stopped, aborted, failed) emits one `engine.contract.UsageEvent` carrying the caller's `metadata`.
"""
