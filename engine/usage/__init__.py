"""Usage events (engine.contract.usage) on their way to metering: a write-ahead log and the broker delivery."""
