"""Interop harness against third-party MOQT stacks (moq-rs, aiomoqt, caprid-relay).

See ``docs/interop.md`` and the peers' notes in the project's shared ``spec/moqt-peers.md``.
"""
