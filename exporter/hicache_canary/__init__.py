"""hicache-canary: reuse canaries and observability for SGLang's hierarchical KV cache."""

__version__ = "0.1.0"
