"""Fine-tuning on the torch side (no Django): data files checked line by line (`dataset`), examples as token ids
through the base model's chat template (`encoding`), and the LoRA training loop with checkpoints (`trainer`)."""
