"""The Index Service role (kvsp-draft §6.1, §6.2)."""
