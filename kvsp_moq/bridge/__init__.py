"""kvsp_moq.bridge (DESIGN.md §2)."""
