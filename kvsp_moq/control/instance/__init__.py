"""The inference instance role (kvsp-draft §6.3, §6.5, §6.8, §6.9)."""
