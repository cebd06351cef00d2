#!/bin/sh
# Checks on a built ELF file, for the CMake consumers' ctest suites:
#   check_library.sh exports FILE PREFIX  every defined dynamic symbol of
#                                         FILE starts with PREFIX
#   check_library.sh soname FILE NAME     FILE's soname is NAME
#   check_library.sh needed FILE NAME     FILE records NAME as needed
set -eu
what=$1 file=$2 want=$3
case $what in
  exports)
    # Symbols the linker defines in every shared object are not exports.
    all=$(nm -D --defined-only "$file" | awk '{print $3}' | grep -v -E '^(_init|_fini|_edata|_end|__bss_start)$' || true)
    count=$(printf '%s\n' "$all" | grep -c . || true)
    others=$(printf '%s\n' "$all" | grep -v "^$want" | grep . || true)
    if [ -n "$others" ]; then
      n=$(printf '%s\n' "$others" | wc -l)
      echo "FAIL $file exports $n symbol(s) besides $want*, for example:"
      printf '%s\n' "$others" | head -n 5
      exit 1
    fi
    if [ "$count" -eq 0 ]; then
      echo "FAIL $file exports nothing"
      exit 1
    fi
    echo "ok: $file exports $count symbol(s), all $want*"
    ;;
  soname)
    got=$(readelf -d "$file" | sed -n 's/.*Library soname: \[\(.*\)\]/\1/p')
    [ "$got" = "$want" ] || { echo "FAIL $file has soname '$got', not '$want'"; exit 1; }
    echo "ok: $file has soname $got"
    ;;
  needed)
    readelf -d "$file" | grep -q "Shared library: \[$want\]" ||
      { echo "FAIL $file does not need $want:"; readelf -d "$file" | grep NEEDED; exit 1; }
    echo "ok: $file needs $want"
    ;;
  *)
    echo "usage: $0 exports|soname|needed FILE WANT" >&2
    exit 2
    ;;
esac
