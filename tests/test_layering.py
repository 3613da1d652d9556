"""The structure rules of DESIGN.md §2, enforced on the source tree (docs/architecture.md has
the map; docs/decisions/0006-packages-by-role.md says why the cuts are where they are).

Every rule is data in this file:

- ``ALLOWED_INTERNAL``: which first-party packages each package may import. Dependencies point
  down: ``kvsp``, ``wire`` <- ``moqt`` <- ``pubsub`` <- ``bridge``, ``relay``; ``transport``
  knows no MOQT; the control plane is one package per role over ``control.common`` and the KVSP
  client library ``control.client``, which imports no route code.
- ``FORBIDDEN_EXTERNAL``: the pure packages import no asyncio, QUIC library, torch or web
  framework; ``QUIC_LIBRARIES`` only in ``transport``; ``WEB_FRAMEWORK`` only in the modules
  ``HTTP_MODULES`` names.
- No import circle between modules (``TYPE_CHECKING`` imports count: a circle of types is still
  a circle for a reader).
- No module over ``MAX_MODULE_LINES`` lines.
- No folder whose modules share a name prefix (``bench_*``): such a family is a package.
- No module imports another module's private name, nor touches ``obj._name`` where ``_name`` is
  not defined in the module itself, except the third-party internals ``THIRD_PARTY_INTERNALS``
  lists (each with the reason the backend needs it).
"""

from __future__ import annotations

import ast
import fnmatch
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOPS = ("kvsp_moq", "relay", "interop")

_LOW = {"kvsp_moq.kvsp", "kvsp_moq.wire", "kvsp_moq.moqt", "kvsp_moq.transport", "kvsp_moq.pubsub",
        "kvsp_moq.storage", "kvsp_moq.sinks", "kvsp_moq.bridge", "kvsp_moq.model"}
_ROLES = ("index", "holder", "pc", "instance", "engine", "frontend", "dashboard", "viewer", "router")
_CONTROL_BASE = _LOW | {"kvsp_moq.control.common"}

# Which first-party packages each package may import (besides itself). A package is
# kvsp_moq.X, kvsp_moq.control.X (the control plane's roles) or a top-level folder.
ALLOWED_INTERNAL: dict[str, set[str]] = {
    "kvsp_moq.kvsp": set(),
    "kvsp_moq.wire": set(),
    "kvsp_moq.moqt": {"kvsp_moq.wire"},
    "kvsp_moq.transport": {"kvsp_moq.wire"},
    "kvsp_moq.pubsub": {"kvsp_moq.wire", "kvsp_moq.moqt", "kvsp_moq.transport"},
    "kvsp_moq.storage": {"kvsp_moq.kvsp"},
    "kvsp_moq.sinks": {"kvsp_moq.kvsp"},
    "kvsp_moq.model": {"kvsp_moq.kvsp"},
    "kvsp_moq.bridge": {"kvsp_moq.kvsp", "kvsp_moq.wire", "kvsp_moq.moqt", "kvsp_moq.transport",
                        "kvsp_moq.pubsub", "kvsp_moq.storage", "kvsp_moq.sinks"},
    # The control plane: shared pieces, the web glue, the client library, then the roles.
    "kvsp_moq.control": set(),
    "kvsp_moq.control.common": _LOW,
    "kvsp_moq.control.http": _CONTROL_BASE,
    "kvsp_moq.control.client": _CONTROL_BASE,
    **{f"kvsp_moq.control.{role}": _CONTROL_BASE | {"kvsp_moq.control.client",
                                                     "kvsp_moq.control.http"}
       for role in _ROLES},
    # Engine connectors embed the client library, never a role's routes.
    "kvsp_moq.integrations": _CONTROL_BASE | {"kvsp_moq.control.client"},
    "kvsp_moq.bench": _LOW,
    "relay": {"kvsp_moq.wire", "kvsp_moq.moqt", "kvsp_moq.transport", "kvsp_moq.pubsub"},
    # The harness starts our relay (with a pinned version list) to test it against peers.
    "interop": {"kvsp_moq.wire", "kvsp_moq.moqt", "kvsp_moq.transport", "kvsp_moq.pubsub", "relay"},
    # The command wires everything together; `python -m kvsp_moq` runs it.
    "kvsp_moq.cli": {"*"},
    "kvsp_moq": {"kvsp_moq.cli"},
}
# Edges between roles that are the design, not an accident: the instance runs the engine.
ALLOWED_INTERNAL["kvsp_moq.control.instance"] |= {"kvsp_moq.control.engine"}

PURE = {"asyncio", "aioquic", "qh3", "aiopquic", "torch", "aiohttp", "uvloop", "socket", "selectors"}
FORBIDDEN_EXTERNAL: dict[str, set[str]] = {
    "kvsp_moq.kvsp": PURE,
    "kvsp_moq.wire": PURE | {"numpy"},
    "kvsp_moq.moqt": PURE | {"numpy"},
}
QUIC_LIBRARIES = {"aioquic", "qh3", "aiopquic"}
QUIC_PACKAGES = {"kvsp_moq.transport", "interop"}  # interop runs peers built on them
WEB_FRAMEWORK = "aiohttp"
# Modules that may import the web framework (fnmatch patterns over module names).
HTTP_MODULES = ("kvsp_moq.control.http", "kvsp_moq.control.http.*",
                "kvsp_moq.control.*.routes", "kvsp_moq.control.*.serve",
                "kvsp_moq.control.client.http")

MAX_MODULE_LINES = 800
# A name-prefix family this size in one folder is a package waiting to happen.
MAX_PREFIX_FAMILY = 2
# Folders exempt from that rule: scripts run one by one inside third-party peers' venvs.
PREFIX_FAMILY_EXEMPT = {"interop/peer_scripts"}

# Third-party internals a module reads (obj._name): each a workaround its module documents
# (docs/transport.md), to be re-checked on an upgrade of that library.
THIRD_PARTY_INTERNALS: dict[str, set[str]] = {
    # aioquic 1.x (listed in aioquic_backend.py's docstring): the congestion-control names it
    # knows, a stream's send buffer (drain), its reset state, a close that has begun, the
    # connection's recovery, controller and pacer (BBR paces at its own rate).
    # The bidi stream credit we grant (aioquic fixes it at 128; TransportConfig.max_streams_bidi).
    "kvsp_moq.transport.aioquic_backend": {"_factories", "_streams", "_reset_error_code", "_buffer",
                                           "_close_event", "_state", "_loss", "_cc", "_pacer",
                                           "_local_max_streams_bidi"},
    # aioquic and qh3: the peer's max_datagram_frame_size (no public accessor).
    "kvsp_moq.transport.library": {"_remote_max_datagram_frame_size"},
    # qh3 2.1: the Rust core, its stream opening and send-window checks, the close event
    # (the anti-amplification and dropped-datagram workarounds, tests/test_transport_qh3.py).
    "kvsp_moq.transport.qh3_backend": {"_open_stream", "_core", "_close_event", "_stream_can_send"},
    # aiopquic 0.6: its event codes and network-thread transport (no public API for either).
    "kvsp_moq.transport.aiopquic.stack": {"_EVT_CLOSE", "_EVT_APP_CLOSE", "_EVT_READY",
                                          "_EVT_STREAM_TX_DRAINED", "_EVT_STREAM_DESTROY", "_transport"},
    # interop/peer_scripts run inside the peers' own venvs against their libraries.
    "interop.peer_scripts.*": {"_profile", "_lifetime"},
}


# --- reading the tree -------------------------------------------------------------------------

@dataclass(frozen=True)
class Module:
    name: str
    path: Path
    tree: ast.Module
    lines: int

    @property
    def is_package(self) -> bool:
        return self.path.name == "__init__.py"


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def read_modules(root: Path) -> dict[str, Module]:
    out = {}
    for top in TOPS:
        for path in sorted((root / top).rglob("*.py")):
            text = path.read_text()
            name = module_name(root, path)
            out[name] = Module(name, path, ast.parse(text, str(path)), len(text.splitlines()))
    return out


def package_of(module: str, packages: Iterable[str]) -> str:
    """The longest package of the rules' table that holds ``module`` (else its first part)."""
    best = module.split(".")[0]
    for pkg in packages:
        if (module == pkg or module.startswith(pkg + ".")) and len(pkg) > len(best):
            best = pkg
    return best


def imported(mod: Module) -> Iterator[tuple[ast.AST, str, str | None]]:
    """(node, imported module or package, imported name or None) for every import."""
    for node in ast.walk(mod.tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node, a.name, None
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = mod.name.split(".")
                base = base[: len(base) - node.level + (1 if mod.is_package else 0)]
                prefix = ".".join(base)
                target = f"{prefix}.{node.module}" if node.module else prefix
            else:
                target = node.module or ""
            for a in node.names:
                yield node, target, a.name


def first_party_targets(mod: Module, modules: dict[str, Module]) -> set[str]:
    """The first-party modules ``mod`` imports (``from pkg import sub`` names the module sub)."""
    out = set()
    for _, target, name in imported(mod):
        if target.split(".")[0] not in TOPS:
            continue
        for candidate in ([f"{target}.{name}"] if name else []) + [target]:
            while candidate and candidate not in modules:
                candidate = candidate.rpartition(".")[0]
            if candidate and candidate != mod.name and not mod.name.startswith(candidate + "."):
                out.add(candidate)
                break
    return out


# --- the rules --------------------------------------------------------------------------------

def unruled_packages(modules: dict[str, Module]) -> list[str]:
    """Packages kvsp_moq.X and kvsp_moq.control.X that the rules' table does not name."""
    out = set()
    for mod in modules.values():
        parts = mod.name.split(".")
        if not mod.is_package or parts[0] != "kvsp_moq":
            continue
        if len(parts) == 2 or (len(parts) == 3 and parts[1] == "control"):
            if mod.name not in ALLOWED_INTERNAL:
                out.add(mod.name)
    return sorted(out)


def layering_violations(modules: dict[str, Module]) -> list[str]:
    out = []
    for mod in modules.values():
        pkg = package_of(mod.name, ALLOWED_INTERNAL)
        allowed = ALLOWED_INTERNAL.get(pkg)
        if allowed is None:
            out.append(f"{mod.name}: package {pkg} has no rule in ALLOWED_INTERNAL")
            continue
        for target in first_party_targets(mod, modules):
            tpkg = package_of(target, ALLOWED_INTERNAL)
            if tpkg != pkg and "*" not in allowed and tpkg not in allowed:
                out.append(f"{mod.name} imports {target} ({pkg} may not depend on {tpkg})")
        for _, target, _name in imported(mod):
            top = target.split(".")[0]
            if top in FORBIDDEN_EXTERNAL.get(pkg, set()):
                out.append(f"{mod.name} imports {target} ({pkg} must stay pure)")
            if top in QUIC_LIBRARIES and pkg not in QUIC_PACKAGES:
                out.append(f"{mod.name} imports {target} (only kvsp_moq.transport may import a QUIC library)")
            if top == WEB_FRAMEWORK and not any(fnmatch.fnmatchcase(mod.name, p) for p in HTTP_MODULES):
                out.append(f"{mod.name} imports {WEB_FRAMEWORK} (only the HTTP modules may)")
    return sorted(set(out))


def import_circles(modules: dict[str, Module]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iteratively)."""
    edges = {name: sorted(first_party_targets(mod, modules)) for name, mod in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []
    counter = 0
    for start in edges:
        if start in index:
            continue
        work = [(start, 0)]
        while work:
            v, i = work.pop()
            if i == 0:
                index[v] = low[v] = counter
                counter += 1
                stack.append(v)
                on_stack.add(v)
            if i < len(edges[v]):
                work.append((v, i + 1))
                w = edges[v][i]
                if w not in index:
                    work.append((w, 0))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    circles.append(sorted(comp))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[v])
    return sorted(circles)


def oversized(modules: dict[str, Module]) -> list[str]:
    return sorted(f"{m.name}: {m.lines} lines" for m in modules.values() if m.lines > MAX_MODULE_LINES)


def prefix_families(root: Path) -> list[str]:
    """Folders holding more than MAX_PREFIX_FAMILY modules named ``P.py`` / ``P_*.py``."""
    out = []
    for top in TOPS:
        for folder in sorted({p.parent for p in (root / top).rglob("*.py")}):
            if str(folder.relative_to(root)) in PREFIX_FAMILY_EXEMPT:
                continue
            stems = [p.stem.lstrip("_") for p in folder.glob("*.py") if p.stem != "__init__"]
            families: dict[str, list[str]] = {}
            for stem in stems:
                if "_" in stem:
                    families.setdefault(stem.split("_")[0], []).append(stem)
            for prefix, members in sorted(families.items()):
                members += [s for s in stems if s == prefix]
                if len(members) > MAX_PREFIX_FAMILY:
                    rel = folder.relative_to(root)
                    out.append(f"{rel}/: {prefix}_* ({', '.join(sorted(members))}) should be a package")
    return out


def _defined_names(tree: ast.Module) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
    return names


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


# Private by the language's convention, public by the library's documentation.
_DOCUMENTED = {"_replace", "_asdict", "_fields", "_make", "_exit", "_getframe", "_field_defaults",
               "_value_", "_name_", "_missing_", "_generate_next_value_"}


def private_reach(modules: dict[str, Module]) -> list[str]:
    out = []
    for mod in modules.values():
        own = _defined_names(mod.tree)
        allowed = set().union(*(attrs for pat, attrs in THIRD_PARTY_INTERNALS.items()
                                if fnmatch.fnmatchcase(mod.name, pat)))
        for node, target, name in imported(mod):
            if target.split(".")[0] not in TOPS:
                continue
            if name and _private(name):
                if f"{target}.{name}" not in modules:
                    out.append(f"{mod.name}:{node.lineno} imports private {target}.{name}")
                elif not (mod.name == target or mod.name.startswith(target + ".")):
                    out.append(f"{mod.name}:{node.lineno} imports {target}.{name} (private to {target})")
            # A private module is its package's own: importing it from outside is reaching in.
            for part_index, part in enumerate(target.split(".")):
                if _private(part):
                    owner = ".".join(target.split(".")[:part_index])
                    if not (mod.name == owner or mod.name.startswith(owner + ".")):
                        out.append(f"{mod.name}:{node.lineno} imports {target} (private to {owner})")
                    break
        for node in ast.walk(mod.tree):
            # self._x / cls._x / super()._x: a class's own or inherited (protected) members.
            inherited = (isinstance(node, ast.Attribute)
                         and (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
                              or isinstance(node.value, ast.Call)
                              and isinstance(node.value.func, ast.Name) and node.value.func.id == "super"))
            if (isinstance(node, ast.Attribute) and _private(node.attr) and node.attr not in own
                    and not inherited and node.attr not in _DOCUMENTED and node.attr not in allowed):
                out.append(f"{mod.name}:{node.lineno} touches {ast.unparse(node)} (private to another module)")
    return sorted(set(out))


# --- the tests --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def modules() -> dict[str, Module]:
    return read_modules(ROOT)


def test_sources_exist(modules: dict[str, Module]) -> None:
    assert "kvsp_moq.kvsp.compat" in modules and "relay" in modules


def test_every_package_has_a_rule(modules: dict[str, Module]) -> None:
    # A new package must be placed in the layering on purpose, not fall under its parent's rule.
    assert unruled_packages(modules) == []


def test_import_rules(modules: dict[str, Module]) -> None:
    assert layering_violations(modules) == []


def test_no_import_circles(modules: dict[str, Module]) -> None:
    assert import_circles(modules) == []


def test_no_oversized_modules(modules: dict[str, Module]) -> None:
    assert oversized(modules) == []


def test_no_name_prefix_families() -> None:
    assert prefix_families(ROOT) == []


def test_no_reaching_into_private_names(modules: dict[str, Module]) -> None:
    assert private_reach(modules) == []


def test_the_client_library_imports_no_route_code(modules: dict[str, Module]) -> None:
    # What an engine embeds (the reference engine, a vLLM connector) must not pull in the HTTP
    # server side: follow the client library's imports transitively.
    seen: set[str] = set()
    todo = [m for m in modules if m == "kvsp_moq.control.client" or m.startswith("kvsp_moq.control.client.")]
    assert todo, "kvsp_moq.control.client is missing"
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        todo += first_party_targets(modules[name], modules)
    servers = sorted(n for n in seen if fnmatch.fnmatchcase(n, "kvsp_moq.control.*.routes")
                     or fnmatch.fnmatchcase(n, "kvsp_moq.control.*.serve")
                     or n.startswith("kvsp_moq.control.http"))
    assert servers == []


def documented_packages(root: Path) -> set[str]:
    """The packages of the table in docs/architecture.md (rows that start with a path)."""
    out = set()
    for line in (root / "docs" / "architecture.md").read_text().splitlines():
        if line.startswith("| `") and "` |" in line:
            path = line[3:line.index("` |")]
            out.add(path.rstrip("/").replace("/", "."))
    return out


def test_the_architecture_map_matches_the_tree(modules: dict[str, Module]) -> None:
    # Every package of the rules' table that exists is on the map, and the map names no
    # package the rules do not know (a planned one may be on the map before it exists).
    existing = {pkg for pkg in ALLOWED_INTERNAL if pkg in modules} - {"kvsp_moq", "kvsp_moq.control"}
    documented = documented_packages(ROOT)
    assert sorted(existing - documented) == []
    assert sorted(documented - set(ALLOWED_INTERNAL)) == []


def test_the_checkers_catch_violations(tmp_path: Path) -> None:
    # A rule that never fires would pass silently: plant one violation of each and see it caught.
    planted = {
        "kvsp_moq/__init__.py": "",
        "kvsp_moq/kvsp/__init__.py": "",
        "kvsp_moq/kvsp/x.py": "import asyncio\nfrom ..moqt import session\n",
        "kvsp_moq/moqt/__init__.py": "",
        "kvsp_moq/moqt/session.py": "from aioquic.quic import connection\n",
        "kvsp_moq/moqt/a.py": "from . import b\nfrom .b import _hidden\n",
        "kvsp_moq/moqt/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\n"
                              "_hidden = 1\n",
        "kvsp_moq/moqt/c.py": "def f(s):\n    return s._secret\n" + "x = 1\n" * MAX_MODULE_LINES,
        "kvsp_moq/moqt/data_one.py": "", "kvsp_moq/moqt/data_two.py": "", "kvsp_moq/moqt/data.py": "",
        "kvsp_moq/control/__init__.py": "",
        "kvsp_moq/control/client/__init__.py": "",
        "kvsp_moq/control/client/lookup.py": "from ..index import routes\n",
        "kvsp_moq/control/index/__init__.py": "",
        "kvsp_moq/control/index/routes.py": "import aiohttp\n",
        "kvsp_moq/control/index/service.py": "import aiohttp\n",
        "kvsp_moq/control/pc/__init__.py": "",
        "kvsp_moq/control/pc/service.py": "from ..index import service\n",
        "kvsp_moq/control/mystery/__init__.py": "",
        "relay/__init__.py": "",
        "relay/z.py": "from kvsp_moq import kvsp\n",
        "interop/__init__.py": "",
    }
    for rel, text in planted.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    mods = read_modules(tmp_path)
    found = layering_violations(mods)
    assert any("kvsp_moq.kvsp.x imports asyncio" in v for v in found)
    assert any("kvsp_moq.kvsp.x imports kvsp_moq.moqt.session" in v for v in found)
    assert any("only kvsp_moq.transport may import" in v for v in found)
    assert any("relay.z imports kvsp_moq.kvsp" in v for v in found)
    assert any("kvsp_moq.control.index.service imports aiohttp" in v for v in found)
    assert not any("kvsp_moq.control.index.routes imports aiohttp" in v for v in found)
    assert any("kvsp_moq.control.client.lookup imports kvsp_moq.control.index.routes" in v for v in found)
    assert any("kvsp_moq.control.pc.service imports kvsp_moq.control.index.service" in v for v in found)
    assert unruled_packages(mods) == ["kvsp_moq.control.mystery"]
    assert import_circles(mods) == [["kvsp_moq.moqt.a", "kvsp_moq.moqt.b"]]
    assert oversized(mods) == [f"kvsp_moq.moqt.c: {MAX_MODULE_LINES + 2} lines"]
    assert any("data_*" in v for v in prefix_families(tmp_path))
    reach = private_reach(mods)
    assert any("imports private kvsp_moq.moqt.b._hidden" in v for v in reach)
    assert any("touches s._secret" in v for v in reach)
