"""Usage events: the schema (`engine.usage.event`, importable without torch) and their delivery."""
