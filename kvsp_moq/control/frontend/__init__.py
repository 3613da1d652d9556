"""The front end role (kvsp-draft §6.8): output delivery, exactly once per index."""
