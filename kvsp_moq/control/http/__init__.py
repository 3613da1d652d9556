"""The web-framework glue of the control-plane roles (aiohttp): application, body readers, problems."""
