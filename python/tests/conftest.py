"""Which xcall the suite tests.

Also gives JAX four CPU devices (the sharding tests' mesh).

By default the source tree's (``python/xcall``, with the library of this
checkout's ``target/``). With ``XCALL_TEST_INSTALLED=1`` the installed
package instead, and the suite fails unless ``xcall`` comes from outside
the source tree and loads the library shipped inside it.
"""

import os
import pathlib
import sys

# Four virtual CPU devices for the sharding tests (set before JAX starts).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    ).strip()

SOURCE = pathlib.Path(__file__).resolve().parent.parent

if os.environ.get("XCALL_TEST_INSTALLED") == "1":
    import xcall

    where = pathlib.Path(xcall.__file__).resolve().parent
    if SOURCE in where.parents:
        raise RuntimeError(f"XCALL_TEST_INSTALLED=1 but xcall comes from the source tree: {where}")
    if os.environ.get("XCALL_LIB"):
        raise RuntimeError("XCALL_TEST_INSTALLED=1 tests the shipped library: unset XCALL_LIB")
    if pathlib.Path(xcall.library_path()).resolve() != where / "libxcall.so":
        raise RuntimeError(f"the installed xcall loads {xcall.library_path()}, not its own library")
else:
    sys.path.insert(0, str(SOURCE))
