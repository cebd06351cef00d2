"""xcall: custom-call building blocks for GPU runtimes, from Python.

The package ships ``libxcall.so`` (xcall's C ABI) inside it; ``xcall.jax``
registers its XLA FFI handlers with JAX and exposes the MoE permutation
ops as JAX functions::

    import xcall.jax as xj

This module only finds and loads the library; it imports no framework.
The library is, in order: ``$XCALL_LIB``; the ``libxcall.so`` of this
package; in a source checkout, the newer of ``target/release`` and
``target/debug``; else whatever the dynamic loader finds.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import pathlib
from typing import Optional

__all__ = ["__version__", "library_path", "load_library"]

__version__ = "0.1.0"

_HERE = pathlib.Path(__file__).resolve().parent
_lib: Optional[ctypes.CDLL] = None


def library_path() -> str:
    """The path of the ``libxcall.so`` that :func:`load_library` loads."""
    env = os.environ.get("XCALL_LIB")
    if env:
        return env
    bundled = _HERE / "libxcall.so"
    if bundled.exists():
        return str(bundled)
    # A source checkout: python/xcall/ -> the repository's target folder.
    root = _HERE.parent.parent
    built = [root / "target" / p / "libxcall.so" for p in ("release", "debug")]
    built = [c for c in built if c.exists()]
    if built:
        # The most recent build, so a stale profile is never picked.
        return str(max(built, key=lambda c: c.stat().st_mtime))
    found = ctypes.util.find_library("xcall")
    if found:
        return found
    raise OSError(
        "xcall: libxcall.so not found: install the package (pip install .), build it "
        "(cargo build --release -p xcall-ffi) or point XCALL_LIB at it"
    )


def load_library(path: Optional[str] = None) -> ctypes.CDLL:
    """Loads ``libxcall.so`` once per process and checks that it is the
    version this package was made for. ``path`` overrides the search on the
    first call only."""
    global _lib
    if _lib is not None:
        return _lib
    path = path or library_path()
    lib = ctypes.CDLL(path)
    lib.xcall_version.restype = ctypes.c_char_p
    version = lib.xcall_version().decode()
    if version.split(".")[:2] != __version__.split(".")[:2]:
        raise OSError(
            f"xcall: the library at {path} is version {version}, "
            f"this package is {__version__}"
        )
    _lib = lib
    return lib
