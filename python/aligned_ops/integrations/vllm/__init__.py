"""The vLLM plugin, one module per concern (see ``install``)."""
