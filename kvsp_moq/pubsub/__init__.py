"""kvsp_moq.pubsub (DESIGN.md §2)."""
