"""kvsp_moq: the KV Cache Storage Protocol (KVSP) with MOQT as its bulk transport."""

__version__ = "0.1.0"
