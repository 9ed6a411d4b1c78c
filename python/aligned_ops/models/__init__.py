"""Model definitions shared by the trainer patch and the vLLM plugin."""
