"""Shared test helpers: tiny random checkpoints (Hugging Face and GGUF) and the reference runner."""
