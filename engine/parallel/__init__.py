"""How the model and its adapters are split over tensor-parallel ranks (sharding) and the collective that joins
the ranks (communicator), docs/tensor-parallel.md. The model layers import these; the worker processes that run the
ranks are engine/workers/."""
