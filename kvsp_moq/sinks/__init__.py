"""kvsp_moq.sinks (DESIGN.md §2)."""
