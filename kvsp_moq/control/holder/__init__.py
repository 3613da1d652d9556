"""The holder role (kvsp-draft §6.6, §6.7)."""
