"""kvrouter: a KV-cache-aware L7 router for SGLang replicas."""
__version__ = "0.1.0"
