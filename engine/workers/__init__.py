"""Tensor parallelism (docs/tensor-parallel.md): rank 0 is the engine process, ranks 1..N-1 are worker
processes it spawns; every rank holds its shard of the weights, of the KV heads and of the adapters' rows."""
