"""Parts of the control plane shared by its roles: auth, configuration, clocks, errors, records."""
