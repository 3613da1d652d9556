"""The import rules of DESIGN.md §2, enforced on the source tree.

Dependencies point down: kvsp, wire <- moqt <- transport <- pubsub <- bridge, control, relay.
kvsp/, wire/ and moqt/ are pure (no asyncio, no QUIC library, no torch); transport/ is the only
package that imports a QUIC library; only control/http/, the role packages' routes.py and
serve.py, and control/client/http.py import the web framework; the relay never imports kvsp_moq.kvsp.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Which first-party packages each package may import (besides itself).
ALLOWED_INTERNAL: dict[str, set[str]] = {
    "kvsp_moq.kvsp": set(),
    "kvsp_moq.wire": set(),
    "kvsp_moq.moqt": {"kvsp_moq.wire"},
    "kvsp_moq.transport": {"kvsp_moq.wire", "kvsp_moq.moqt"},
    "kvsp_moq.pubsub": {"kvsp_moq.wire", "kvsp_moq.moqt", "kvsp_moq.transport"},
    "kvsp_moq.storage": {"kvsp_moq.kvsp"},
    "kvsp_moq.sinks": {"kvsp_moq.kvsp"},
    "kvsp_moq.model": {"kvsp_moq.kvsp"},
    "kvsp_moq.bridge": {"kvsp_moq.kvsp", "kvsp_moq.wire", "kvsp_moq.moqt", "kvsp_moq.transport",
                        "kvsp_moq.pubsub", "kvsp_moq.storage", "kvsp_moq.sinks"},
    "kvsp_moq.control": {"kvsp_moq.kvsp", "kvsp_moq.storage", "kvsp_moq.bridge", "kvsp_moq.sinks",
                         "kvsp_moq.pubsub", "kvsp_moq.transport", "kvsp_moq.moqt", "kvsp_moq.wire",
                         "kvsp_moq.model"},
    "kvsp_moq.bench": {"kvsp_moq.kvsp", "kvsp_moq.wire", "kvsp_moq.moqt", "kvsp_moq.transport",
                       "kvsp_moq.pubsub", "kvsp_moq.storage", "kvsp_moq.sinks", "kvsp_moq.bridge",
                       "kvsp_moq.model"},
    "relay": {"kvsp_moq.wire", "kvsp_moq.moqt", "kvsp_moq.transport", "kvsp_moq.pubsub"},
    # The harness starts our relay (with a pinned version list) to test it against peers.
    "interop": {"kvsp_moq.wire", "kvsp_moq.moqt", "kvsp_moq.transport", "kvsp_moq.pubsub", "relay"},
}
# Third-party or stdlib modules a package must not import.
PURE = {"asyncio", "aioquic", "qh3", "aiopquic", "torch", "aiohttp", "uvloop", "socket", "selectors"}
FORBIDDEN_EXTERNAL: dict[str, set[str]] = {
    "kvsp_moq.kvsp": PURE,
    "kvsp_moq.wire": PURE | {"numpy"},
    "kvsp_moq.moqt": PURE | {"numpy"},
}
QUIC_LIBS = {"aioquic", "qh3", "aiopquic"}


def _package_of(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "kvsp_moq" and len(parts) > 1 else parts[0]


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> list[str]:
    module = _module_name(path)
    is_pkg = path.name == "__init__.py"
    tree = ast.parse(path.read_text(), str(path))
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_pkg else 0)]
                prefix = ".".join(base)
                target = f"{prefix}.{node.module}" if node.module else prefix
            else:
                target = node.module or ""
            # `from kvsp_moq import kvsp` imports kvsp_moq.kvsp: record each imported name.
            names += [f"{target}.{a.name}" for a in node.names]
    return names


def _sources() -> list[Path]:
    files = []
    for top in ("kvsp_moq", "relay", "interop"):
        files += sorted((ROOT / top).rglob("*.py"))
    return files


CONTROL_ROLES = ("index", "holder", "pc", "instance", "engine", "frontend")


def _may_import_web_framework(module: str) -> bool:
    """control/http/*, ``routes``/``serve`` of a role package, and the client library's HTTP clients."""
    parts = module.split(".")
    if parts[:2] != ["kvsp_moq", "control"] or len(parts) < 3:
        return False
    if parts[2] == "http" or parts[2:] == ["client", "http"]:
        return True
    return len(parts) == 4 and parts[2] in CONTROL_ROLES and parts[3] in ("routes", "serve")


def _violations(path: Path) -> list[str]:
    module = _module_name(path)
    pkg = _package_of(module)
    out = []
    for name in _imports(path):
        top = name.split(".")[0]
        if top in ("kvsp_moq", "relay", "interop"):
            target = _package_of(name)
            if target in (pkg, "kvsp_moq") or module == "kvsp_moq.cli" or pkg == "kvsp_moq.cli":
                continue
            if pkg in ALLOWED_INTERNAL and target not in ALLOWED_INTERNAL[pkg]:
                out.append(f"{module} imports {name} ({pkg} may not depend on {target})")
        if top in FORBIDDEN_EXTERNAL.get(pkg, set()):
            out.append(f"{module} imports {name} ({pkg} must stay pure)")
        if top in QUIC_LIBS and pkg != "kvsp_moq.transport" and pkg not in ("interop",):
            out.append(f"{module} imports {name} (only kvsp_moq.transport may import a QUIC library)")
        if top == "aiohttp" and not _may_import_web_framework(module):
            out.append(f"{module} imports aiohttp (only kvsp_moq.control's HTTP modules may)")
    return out


def test_sources_exist() -> None:
    assert any(p.name == "compat.py" for p in _sources())


def test_import_rules() -> None:
    problems = [v for path in _sources() for v in _violations(path)]
    assert problems == []


def test_the_checker_catches_violations(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A rule that never fires would pass silently: plant violations and see each caught.
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    bad = {
        "kvsp_moq/kvsp/x.py": "import asyncio\nfrom ..moqt import session\n",
        "kvsp_moq/moqt/y.py": "from aioquic.quic import connection\n",
        "relay/z.py": "from kvsp_moq import kvsp\n",
        "kvsp_moq/control/svc.py": "import aiohttp\n",
    }
    for rel, text in bad.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    found = [v for rel in bad for v in _violations(tmp_path / rel)]
    assert any("kvsp_moq.kvsp.x imports asyncio" in v for v in found)
    assert any("kvsp_moq.kvsp.x imports kvsp_moq.moqt.session" in v for v in found)
    assert any("only kvsp_moq.transport may import" in v for v in found)
    assert any("relay.z imports kvsp_moq.kvsp" in v for v in found)
    assert any("only kvsp_moq.control's HTTP modules may" in v for v in found)
