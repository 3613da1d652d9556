"""The system programs the suite starts itself (Debian's ``redis-server`` and ``chromium``) and
the system libraries the package's native build needs (ngtcp2, GnuTLS: their headers),
read from the one list of them, ``.ci/system-packages.txt`` (``$KVSP_SYSTEM_PROGRAMS`` names
another list: the tests of this module's own rules use it).

``tests/conftest.py`` applies it at collection: a test that needs a missing program is skipped
with one reason that names the program and the command that installs it, and the skips are
reported under that list's line (``SKIPPED [48] .ci/system-packages.txt:6: ...``), once. Under
CI (``CI=true``, as ``.ci/run`` runs) the same tests fail instead: the test command installed
the programs, so a missing one is a bug. Holds no tests.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_LIST = ROOT / ".ci" / "system-packages.txt"
INSTALL_COMMAND = "bash .ci/system-packages.sh"


@dataclass(frozen=True)
class SystemProgram:
    """One line of the list: the program's path, its Debian package, the test modules (file
    names under tests/) whose tests need it, and where the line is (for the skip report)."""

    path: str
    package: str
    modules: frozenset[str]
    list_file: Path
    line: int

    @property
    def present(self) -> bool:
        # a program, or a file a build needs (a library's header): there is what counts
        return os.path.exists(self.path)

    @property
    def reason(self) -> str:
        return (f"{self.path} is missing (Debian package {self.package}): "
                f"`{INSTALL_COMMAND}` installs it (the README's test command runs it)")

    def needed_by(self, item: pytest.Item) -> bool:
        """Every test of a listed module, but one parametrized onto the in-memory store."""
        if item.path.name not in self.modules:
            return False
        callspec = getattr(item, "callspec", None)
        return callspec is None or "memory" not in callspec.params.values()


def list_file() -> Path:
    return Path(os.environ.get("KVSP_SYSTEM_PROGRAMS", DEFAULT_LIST))


def load(path: Path | None = None) -> list[SystemProgram]:
    """The programs of ``path`` (the list in use by default); a malformed line is an error."""
    path = path or list_file()
    programs = []
    for number, text in enumerate(path.read_text().splitlines(), start=1):
        fields = text.split()
        if not fields or fields[0].startswith("#"):
            continue
        if len(fields) < 3 or not fields[0].startswith("/"):
            raise ValueError(f"{path}:{number}: want `/path/of/program package "
                             f"test_module.py ...`, got {text!r}")
        programs.append(SystemProgram(fields[0], fields[1], frozenset(fields[2:]), path, number))
    return programs


def under_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def missing_failure(program: SystemProgram) -> str:
    return f"{program.reason}; CI=true: the test command should have installed it"


def require(path: str) -> None:
    """For code that starts a listed program outside the listed modules: skip the test (fail it
    under CI) with the list's reason if the program is missing."""
    for program in load():
        if program.path == path and not program.present:
            if under_ci():
                pytest.fail(missing_failure(program), pytrace=False)
            pytest.skip(program.reason)
    if not os.path.exists(path):
        pytest.fail(f"{path} is missing and not in {list_file()}: add it there", pytrace=False)
