"""memplan: per-GPU memory of LLM training and inference, and the fastest plan that fits."""

__version__ = "0.1.0"
