"""The Placement Controller role (kvsp-draft §6.3, §6.4, §6.8, §6.9)."""
