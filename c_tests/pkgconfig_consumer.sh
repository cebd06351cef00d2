#!/bin/sh
# Builds and runs the consumer program against an installed xcall through
# pkg-config: xcall.pc (the shared library) and xcall-static.pc (the static
# one), and a plugin through xcall-static.pc that must export only its own
# symbols.
#   c_tests/pkgconfig_consumer.sh PREFIX BUILD_DIR
set -eu
prefix=$1 out=$2
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
libdir=$(dirname "$(find "$prefix" -name xcall.pc -path '*/pkgconfig/*' | head -n 1)")
[ -f "$libdir/xcall.pc" ] || { echo "FAIL no xcall.pc under $prefix"; exit 1; }
export PKG_CONFIG_PATH="$libdir${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
echo "pkg-config: xcall $(pkg-config --modversion xcall), xcall-static $(pkg-config --modversion xcall-static)"
cxx=${CXX:-c++}
cc=${CC:-cc}
# shellcheck disable=SC2046
$cxx -std=c++17 "$here/cmake_consumer/consumer.cpp" $(pkg-config --cflags --libs xcall) \
  -Wl,-rpath,"$(pkg-config --variable=libdir xcall)" -o "$out/pc_shared"
# shellcheck disable=SC2046
$cxx -std=c++17 "$here/cmake_consumer/consumer.cpp" $(pkg-config --cflags --libs xcall-static) -o "$out/pc_static"
# shellcheck disable=SC2046
$cc -shared -fPIC -fvisibility=hidden "$here/cmake_consumer/plugin.c" $(pkg-config --cflags --libs xcall-static) \
  -o "$out/libpc_plugin.so"
"$out/pc_shared"
"$out/pc_static"
sh "$here/check_library.sh" needed "$out/pc_shared" libxcall.so.0
if readelf -d "$out/pc_static" | grep -q 'libxcall'; then
  echo "FAIL pc_static needs a shared libxcall"
  exit 1
fi
sh "$here/check_library.sh" exports "$out/libpc_plugin.so" plugin_
echo "pkg-config consumers: ok"
