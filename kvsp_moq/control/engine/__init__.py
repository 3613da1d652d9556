"""The inference engine an instance runs (docs/engine.md)."""
