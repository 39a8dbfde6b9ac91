"""The demo model: `python -m engine.demo [--out DIR]` builds a tiny Llama and PEFT adapters."""
