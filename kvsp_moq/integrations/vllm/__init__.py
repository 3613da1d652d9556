"""The KVSP connector for vLLM (docs/vllm.md). vLLM is imported lazily: this package imports
without it, and only :mod:`.connector` (the class vLLM loads) needs it."""
