#!/usr/bin/env python3
"""Writes a copy of an NCCL library whose GPU code serves one architecture.

    scripts/slim-nccl.py LIBNCCL OUT [SM]

An NCCL of the NVIDIA wheels (nvidia-nccl-cu13: nvidia/nccl/lib/libnccl.so.2)
holds compiled kernels for every GPU architecture: some 340 MB, too much to
carry to a GPU machine for a test. This copy keeps the machine code for one
architecture (SM, default 90: H100 and H200) and zeroes the rest, PTX
included: the payload of every other entry of the fat binaries in the
`.nv_fatbin` and `__nv_relfatbin` sections. Nothing moves, so the ELF file
stays valid and the zeros compress to almost nothing (`xz`: about 44 MB).
The copy loads and runs on GPUs of that architecture only: CUDA finds no
kernel for any other (and no PTX to compile one from).

Used to run xcall's one-sided NCCL path (NCCL 2.29 and newer) on GPU
machines whose own NCCL is older: point XCALL_NCCL_LIB at the copy.
"""

import struct
import subprocess
import sys

FATBIN_MAGIC = 0xBA55ED50
ELF_KIND = 2
SECTIONS = (".nv_fatbin", "__nv_relfatbin")


def sections(path):
    """(offset, size) in the file of each section of SECTIONS it has."""
    out = {}
    listing = subprocess.run(["readelf", "-S", "-W", path], capture_output=True, text=True, check=True)
    for line in listing.stdout.splitlines():
        parts = line.replace("[ ", "[").split()
        if len(parts) > 5 and parts[1] in SECTIONS:
            out[parts[1]] = (int(parts[4], 16), int(parts[5], 16))
    return out


def slim(data, offset, size, sm):
    """Zeroes, in place, the payload of every entry of the fat binaries in
    data[offset:offset + size] that is not SM machine code; returns the
    bytes kept and the bytes zeroed."""
    kept = zeroed = 0
    p, end = offset, offset + size
    while p + 16 <= end:
        magic, _version, header, fat = struct.unpack_from("<IHHQ", data, p)
        if magic != FATBIN_MAGIC:
            # Fat binaries are 8-byte aligned, padding between them.
            p += 8
            continue
        q, q_end = p + header, p + header + fat
        while q < q_end:
            kind, _v, entry_header, payload = struct.unpack_from("<HHIQ", data, q)
            arch = struct.unpack_from("<I", data, q + 28)[0]
            start = q + entry_header
            if kind == ELF_KIND and arch == sm:
                kept += payload
            else:
                data[start:start + payload] = bytes(payload)
                zeroed += payload
            q = start + payload
        p = q_end
    return kept, zeroed


def main():
    if len(sys.argv) not in (3, 4):
        sys.exit(__doc__)
    src, dst = sys.argv[1], sys.argv[2]
    sm = int(sys.argv[3]) if len(sys.argv) == 4 else 90
    found = sections(src)
    if not found:
        sys.exit(f"{src}: no {' or '.join(SECTIONS)} section: not a CUDA library")
    data = bytearray(open(src, "rb").read())
    for name, (offset, size) in sorted(found.items()):
        kept, zeroed = slim(data, offset, size, sm)
        if kept == 0:
            sys.exit(f"{src}: {name} has no sm_{sm} machine code")
        print(f"{name}: kept {kept >> 20} MiB of sm_{sm} code, zeroed {zeroed >> 20} MiB")
    with open(dst, "wb") as f:
        f.write(data)


if __name__ == "__main__":
    main()
