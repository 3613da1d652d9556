"""Pure KVSP core (kvsp-draft §4): no I/O, no asyncio, no torch.

Compatibility Descriptor and ID (§4.1), Scope IDs and Block Keys (§4.2), the KVB1 container
(§4.3), the registries (§11.2), records (§4.4 and the JSON bodies of §6), problem types and
the MOQT naming of blocks (binding v1, docs/binding.md).
"""
