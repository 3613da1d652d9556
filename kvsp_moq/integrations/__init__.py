"""Engine connectors on the KVSP client library (DESIGN.md §2): vLLM's KV connector API first
(:mod:`.vllm`, docs/vllm.md). Nothing here imports an engine at import time."""
