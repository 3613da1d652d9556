"""kvsp_moq.control (DESIGN.md §2)."""
