"""kvsp_moq: the KV Cache Storage Protocol (KVSP) with MOQT as its bulk transport."""

from importlib.metadata import PackageNotFoundError, version

try:
    #: The installed distribution's version (pyproject.toml's ``version``).
    __version__ = version("kvsp-moq")
except PackageNotFoundError:  # run from a checkout that is not installed
    __version__ = "0.1.0"
