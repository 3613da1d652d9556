"""Configuration of the control-plane servers: one TOML file (docs/http-api.md "Configuration").

```toml
[index]                      # the Index Service; every key optional
base_path = "/"              # the IS base: routes are {base_path}lookup, ...
max_ttl_ms = 600000          # cap on a replica record's ttl_ms (§6.1)
max_status_ttl_ms = 60000    # cap on an instance status record's ttl_ms (§6.3)
max_body_octets = 5242880    # larger request bodies get 413
max_block_keys = 65536       # cap on block_keys in one lookup (§6.2)
purge_interval_ms = 5000     # how often expired records are reclaimed (0: never)
max_descriptors = 1024       # cap on registered Compatibility Descriptors
descriptors = ["model.json"] # descriptor files (JSON, §4.1), relative to this file

[[principals]]               # see kvsp_moq/control/auth.py
name = "holder-h1"
token = "..."                # or token_sha256 = "<hex of SHA-256(token)>"
scopes = ["<hex16>"]         # or ["*"]
holders = ["https://h1.example/kvsp/"]
instances = []
```

Unknown keys are errors: a misspelt limit or grant must not pass silently.
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from ..kvsp.compat import validate_descriptor
from ..kvsp.errors import DescriptorError
from .auth import Authorizer
from .errors import ConfigError

MiB = 1 << 20


@dataclass(frozen=True)
class IndexConfig:
    """Limits and settings of the Index Service (§6.1, §6.2)."""

    base_path: str = "/"
    max_ttl_ms: int = 600_000
    max_status_ttl_ms: int = 60_000
    max_body_octets: int = 5 * MiB
    max_block_keys: int = 65_536
    purge_interval_ms: int = 5_000
    max_descriptors: int = 1_024
    #: Validated descriptor documents (§4.1), loaded from the files named in the TOML.
    descriptors: tuple[Mapping[str, Any], ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        if not (self.base_path.startswith("/") and self.base_path.endswith("/")):
            raise ConfigError("index.base_path", "must start and end with '/'")
        for name, minimum in (
            ("max_ttl_ms", 1),
            ("max_status_ttl_ms", 1),
            ("max_body_octets", 1024),
            ("max_block_keys", 1),
            ("purge_interval_ms", 0),
            ("max_descriptors", 0),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ConfigError(f"index.{name}", f"must be an integer >= {minimum}")


@dataclass(frozen=True)
class ControlConfig:
    """A whole configuration file: the principals and each role's section."""

    auth: Authorizer
    index: IndexConfig = IndexConfig()


def load_config(path: str | Path) -> ControlConfig:
    """Read a TOML configuration; :class:`ConfigError` names the key at fault."""
    path = Path(path)
    try:
        with open(path, "rb") as fh:
            doc = tomllib.load(fh)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("", f"{path}: not valid TOML: {exc}") from None
    except OSError as exc:
        raise ConfigError("", f"{path}: {exc.strerror or exc}") from None
    return config_from_mapping(doc, base_dir=path.parent)


def config_from_mapping(doc: Mapping[str, Any], *, base_dir: Path | None = None) -> ControlConfig:
    """The same from a decoded mapping; descriptor paths are relative to ``base_dir``."""
    unknown = set(doc) - {"index", "principals"}
    if unknown:
        raise ConfigError(sorted(unknown)[0], "unknown section")
    auth = Authorizer.from_config(doc.get("principals", []))
    index = _index_config(doc.get("index", {}), base_dir or Path.cwd())
    return ControlConfig(auth=auth, index=index)


def _index_config(section: object, base_dir: Path) -> IndexConfig:
    if not isinstance(section, dict):
        raise ConfigError("index", "must be a table")
    known = {f.name for f in fields(IndexConfig)}
    values = dict(section)
    unknown = set(values) - known
    if unknown:
        raise ConfigError(f"index.{sorted(unknown)[0]}", "unknown key")
    files = values.pop("descriptors", [])
    if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
        raise ConfigError("index.descriptors", "must be an array of file names")
    if "base_path" in values and not isinstance(values["base_path"], str):
        raise ConfigError("index.base_path", "must be a string")
    documents = tuple(_descriptor(base_dir / name, f"index.descriptors[{i}]") for i, name in enumerate(files))
    return IndexConfig(**values, descriptors=documents)


def _descriptor(path: Path, key: str) -> Mapping[str, Any]:
    try:
        document = json.loads(path.read_bytes())
    except OSError as exc:
        raise ConfigError(key, f"{path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise ConfigError(key, f"{path}: not valid JSON: {exc}") from None
    try:
        return validate_descriptor(document).document
    except DescriptorError as exc:
        raise ConfigError(key, f"{path}: {exc}") from None
