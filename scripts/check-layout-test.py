#!/usr/bin/env python3
"""Tests scripts/check-layout.py on small workspaces written to a
temporary folder: a circle, no circle, a long file with and without its
reason. Run by .ci/run before the check itself:

    python3 scripts/check-layout-test.py
"""

import os
import shutil
import subprocess
import sys
import tempfile
import unittest

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "check-layout.py")


def workspace(files):
    """A temporary workspace holding `files` ({relative path: text})."""
    root = tempfile.mkdtemp(prefix="check-layout-")
    for rel, text in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(text)
    return root


def check(files):
    """(exit code, stdout) of the script over a workspace of `files`."""
    root = workspace(files)
    try:
        out = subprocess.run([sys.executable, SCRIPT, root], capture_output=True, text=True)
    finally:
        shutil.rmtree(root)
    return out.returncode, out.stdout


def lines(n, first="// plain"):
    return first + "\n" + "".join(f"pub const C{i}: u32 = {i};\n" for i in range(n - 1))


class Circles(unittest.TestCase):
    def test_two_siblings_that_use_each_other_are_a_circle(self):
        code, out = check({
            "crates/a/src/lib.rs": "mod x;\nmod y;\n",
            "crates/a/src/x.rs": "use crate::y::Y;\npub struct X;\n",
            "crates/a/src/y.rs": "pub struct Y;\nfn f() -> crate::x::X { crate::x::X }\n",
        })
        self.assertEqual(code, 1, out)
        self.assertIn("layout: 1 import circles, 0 long files without a reason", out)
        self.assertIn("import circle in a: crates/a/src/x.rs, crates/a/src/y.rs", out)
        self.assertIn("crates/a/src/x.rs uses crate::y::Y", out)
        self.assertIn("crates/a/src/y.rs uses crate::x::X", out)

    def test_a_circle_through_a_child_module_and_super(self):
        # boot -> world (MAX) -> world/live (declared child) -> boot, as
        # `use live::..`, `super::super::boot` and a brace tree.
        code, out = check({
            "crates/s/src/lib.rs": "pub mod boot;\npub mod world;\n",
            "crates/s/src/boot.rs": "pub fn f() -> usize { crate::world::MAX }\n",
            "crates/s/src/world/mod.rs": "mod live;\nuse live::{Live, other::*};\npub const MAX: usize = 8;\n",
            "crates/s/src/world/live.rs": "use super::super::{boot::f, world};\npub struct Live;\n",
        })
        self.assertEqual(code, 1, out)
        self.assertIn(
            "import circle in s: crates/s/src/boot.rs, crates/s/src/world/live.rs, "
            "crates/s/src/world/mod.rs", out)
        self.assertIn("layout: 1 import circles", out)

    def test_each_crate_and_each_circle_counts_once(self):
        one = {
            "src/lib.rs": "mod x;\nmod y;\nmod z;\n",
            "src/x.rs": "use crate::y::Y;\nuse crate::z::Z;\npub struct X;\n",
            "src/y.rs": "use crate::x::X;\npub struct Y;\n",
            "src/z.rs": "use crate::x::X;\npub struct Z;\n",
        }
        files = {f"crates/{c}/{p}": t for c in ("a", "b") for p, t in one.items()}
        code, out = check(files)
        self.assertEqual(code, 1, out)
        self.assertIn("layout: 2 import circles", out)

    def test_no_circle(self):
        code, out = check({
            "crates/a/src/lib.rs": "mod x;\nmod y;\npub use x::X;\npub type Result = u32;\n",
            # A one-way use, uses of enclosing modules (the root, super).
            "crates/a/src/x.rs": "use crate::y::Y;\nuse crate::Result;\npub struct X;\n",
            "crates/a/src/y.rs": (
                "pub struct Y;\n"
                "mod inner { use super::Y; fn f() -> super::super::Result { 0 } }\n"
                # Text that only looks like a path.
                "// crate::x::X in a comment\n"
                "const S: &str = \"crate::x::X in a string\";\n"
                "const R: &str = r#\"crate::x::X \" raw\"#;\n"
                "const C: char = '\"'; fn g<'a>(s: &'a str) -> &'a str { s }\n"
                # Tests may use anything.
                "#[cfg(test)]\nmod tests {\n    use crate::x::X;\n}\n"
                "#[cfg(test)]\nmod more;\n"
                "#[cfg(test)]\nfn helper() -> crate::x::X { crate::x::X }\n"
            ),
            "crates/a/src/y/more.rs": "use crate::x::X;\n",
            # Binaries are crates of their own.
            "crates/a/src/bin/tool.rs": "mod x;\nuse crate::x;\n",
        })
        self.assertEqual(code, 0, out)
        self.assertIn("layout: 0 import circles, 0 long files without a reason", out)


class LongFiles(unittest.TestCase):
    def test_a_long_file_without_its_reason_fails(self):
        code, out = check({
            "crates/a/src/lib.rs": "mod big;\n",
            "crates/a/src/big.rs": lines(701, "//! Many constants."),
        })
        self.assertEqual(code, 1, out)
        self.assertIn("long file: crates/a/src/big.rs has 701 lines (over 700)", out)
        self.assertIn("layout: 0 import circles, 1 long files without a reason", out)

    def test_a_reason_on_the_second_line_is_not_enough(self):
        code, out = check({
            "crates/a/src/lib.rs": lines(800, "//! The crate.\n//! Long because of the constants."),
        })
        self.assertEqual(code, 1, out)
        self.assertIn("crates/a/src/lib.rs has 801 lines", out)

    def test_a_long_file_with_its_reason_and_700_lines_pass(self):
        for first in ("//! Long because the 800 constants are one table.",
                      "// long because the 800 constants are one table."):
            code, out = check({
                "crates/a/src/lib.rs": "mod big;\nmod edge;\n",
                "crates/a/src/big.rs": lines(800, first),
                "crates/a/src/edge.rs": lines(700),
                # Only library sources count.
                "crates/a/tests/huge.rs": lines(2000),
            })
            self.assertEqual(code, 0, out)
            self.assertIn("layout: 0 import circles, 0 long files without a reason", out)

    def test_a_reason_must_say_something(self):
        code, out = check({"crates/a/src/lib.rs": lines(701, "//! Long because")})
        self.assertEqual(code, 1, out)


class Usage(unittest.TestCase):
    def test_a_folder_without_crates_is_refused(self):
        root = workspace({"README.md": "no crates\n"})
        out = subprocess.run([sys.executable, SCRIPT, root], capture_output=True, text=True)
        shutil.rmtree(root)
        self.assertEqual(out.returncode, 2)
        self.assertIn("is not a folder", out.stderr)


if __name__ == "__main__":
    unittest.main()
