"""kvsp_moq.moqt (DESIGN.md §2)."""
