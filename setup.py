"""The optional C extension of kvsp-moq: the native QUIC data plane,
``kvsp_moq.transport.native._ngtcp2`` (ngtcp2 0.12 with GnuTLS, flags from pkg-config).

Every other piece of metadata is in pyproject.toml. Without pkg-config or the libraries, or
when the compile fails, the package installs without the extension after one warning naming
the Debian packages to install; ``kvsp_moq.transport.native.available()`` then says False.
``KVSP_NATIVE_SANITIZE=1`` builds it with AddressSanitizer and UndefinedBehaviorSanitizer.
"""

from __future__ import annotations

import os
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CCompilerError, CompileError, ExecError, LinkError, PlatformError

NATIVE = "kvsp_moq/transport/native"
PKG_CONFIG_NAMES = ["libngtcp2", "libngtcp2_crypto_gnutls", "gnutls"]
DEBIAN_PACKAGES = "libngtcp2-dev libngtcp2-crypto-gnutls-dev libgnutls28-dev"
SOURCES = ["_ngtcp2module.c", "_ngtcp2objects.c", "nq_api.c", "nq_buf.c", "nq_close.c",
           "nq_conn.c", "nq_endpoint.c", "nq_events.c", "nq_hasher.c", "nq_map.c", "nq_moqt.c",
           "nq_objects.c", "nq_stream.c", "nq_tls.c", "nq_udp.c", "nq_write.c"]
CFLAGS = ["-std=c11", "-D_GNU_SOURCE", "-Wall", "-Wextra", "-Werror"]
SANITIZE = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-O1", "-g"]


def pkg_config(option: str) -> list[str]:
    """``pkg-config <option>`` for the three libraries (OSError / CalledProcessError when
    pkg-config or one of them is missing)."""
    out = subprocess.run(["pkg-config", option, *PKG_CONFIG_NAMES], check=True,
                         capture_output=True, text=True).stdout
    return out.split()


def warn_not_built(reason: str) -> None:
    print(f"WARNING: kvsp-moq: the native QUIC backend (kvsp_moq.transport.native._ngtcp2) "
          f"was not built: {reason}. Install {DEBIAN_PACKAGES} and reinstall "
          f"(pip install -e .).", file=sys.stderr)


class OptionalNativeBuild(build_ext):
    """build_ext that configures the extension from pkg-config and lets the package install
    without it when it cannot be built."""

    def build_extension(self, ext: Extension) -> None:
        try:
            cflags, libs = pkg_config("--cflags"), pkg_config("--libs")
        except (OSError, subprocess.CalledProcessError) as exc:
            detail = (getattr(exc, "stderr", "") or str(exc)).strip().splitlines()
            warn_not_built(f"pkg-config found no {' '.join(PKG_CONFIG_NAMES)} "
                           f"({detail[0] if detail else exc!r})")
            return
        sanitize = SANITIZE if os.environ.get("KVSP_NATIVE_SANITIZE") == "1" else []
        ext.extra_compile_args = [*CFLAGS, *sanitize, *cflags]
        ext.extra_link_args = [*sanitize, *libs]
        try:
            super().build_extension(ext)
        except (CCompilerError, CompileError, ExecError, LinkError, PlatformError) as exc:
            warn_not_built(f"the compile failed ({exc})")


setup(
    ext_modules=[
        Extension(
            "kvsp_moq.transport.native._ngtcp2",
            sources=[f"{NATIVE}/{name}" for name in SOURCES],
            depends=[f"{NATIVE}/{name}" for name in ("nq.h", "nq_moqt.h", "_ngtcp2objects.h")],
            optional=True,
        )
    ],
    cmdclass={"build_ext": OptionalNativeBuild},
)
