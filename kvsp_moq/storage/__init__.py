"""kvsp_moq.storage (DESIGN.md §2)."""
