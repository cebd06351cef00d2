#!/usr/bin/env python3
"""Checks two rules of the workspace's layout (docs/ARCHITECTURE.md,
"Layout rules") and fails when either is broken:

1. No import circle between the modules of a crate. Each source file under
   a crate's src/ is one module (a file's inline `mod x { .. }` blocks
   belong to it). A file depends on the module a path of it names:
   `use crate::..`, `use super::..`, `use self::..`, a `use` of a child
   module (`use live::Live` after `mod live;`), and the same paths written
   inline in code (`crate::world::MAX_PES`, `super::f()`, `live::f()`).
   Not counted: a `mod x;` declaration alone; a use of an enclosing
   module (`super::x`, or `crate::Result` from the crate root): a child
   module is part of its parent; and items under `#[cfg(test)]` (test
   modules, inline or in their own file). Each strongly connected set of
   two or more files is one circle; it is printed with one cycle through
   it.
2. A library source file (crates/*/src/**/*.rs) of more than 700 lines
   says why on its first line: a `//!` or `//` comment that starts with
   "Long because" and gives a reason, for example
   `//! Long because the 12 kernel families share one table and one test.`

Prints each finding, then the counts:
    layout: N import circles, M long files without a reason
and exits 1 when either count is not 0.

    scripts/check-layout.py [ROOT]   (ROOT: the workspace, default the
                                      checkout this script is in)
"""

import os
import re
import sys

MAX_LINES = 700
REASON = re.compile(r"^//!?\s*Long because\s+\S.{9,}", re.IGNORECASE)
IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def tokens(text):
    """Rust tokens that matter for paths and attributes: identifiers,
    `::`, `{`, `}`, `;`, `,`, `*`, `$`, `=`, `#`, brackets and parentheses;
    comments, strings, chars and lifetimes
    are dropped (other punctuation becomes one `?` token)."""
    i, n = 0, len(text)
    out = []
    while i < n:
        c = text[i]
        if c.isspace():
            i += 1
        elif text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j + 1
        elif text.startswith("/*", i):
            depth, i = 1, i + 2
            while i < n and depth:
                if text.startswith("/*", i):
                    depth, i = depth + 1, i + 2
                elif text.startswith("*/", i):
                    depth, i = depth - 1, i + 2
                else:
                    i += 1
        elif c == '"' or (c in "br" and re.match(r'(b?r#*"|b")', text[i:i + 258])):
            m = re.match(r'b?r(#*)"', text[i:i + 258])
            if m:  # raw string: ends at a quote followed by as many #
                end = text.find('"' + m.group(1), i + m.end())
                i = n if end < 0 else end + 1 + len(m.group(1))
            else:
                i = text.index('"', i) + 1
                while i < n and text[i] != '"':
                    i += 2 if text[i] == "\\" else 1
                i += 1
        elif c == "'":
            # A char literal ('a', '\n', '\u{1F600}') or a lifetime ('a).
            m = re.match(r"'(\\.[^']*|[^\\'])'", text[i:i + 12])
            if m:
                i += m.end()
            else:
                i += 1
                while i < n and (text[i].isalnum() or text[i] == "_"):
                    i += 1
        elif c.isalpha() or c == "_":
            m = IDENT.match(text, i)
            # r#ident is a raw identifier.
            out.append(m.group(0))
            i = m.end()
        elif text.startswith("::", i):
            out.append("::")
            i += 2
        elif c in "{};,*$=#[]()":
            out.append(c)
            i += 1
        elif c.isdigit():
            while i < n and (text[i].isalnum() or text[i] in "_."):
                i += 1
            out.append("?")
        else:
            out.append("?")
            i += 1
    return out


def skip_item(toks, k):
    """The index after the item starting at toks[k] (its attributes, then
    up to its `;` or its closing brace)."""
    while k + 1 < len(toks) and toks[k] == "#" and toks[k + 1] == "[":
        k = skip_group(toks, k + 1)
    nest = 0
    while k < len(toks):
        t = toks[k]
        if t in "([":
            nest += 1
        elif t in ")]":
            nest -= 1
        elif t == ";" and nest == 0:
            return k + 1
        elif t == "{" and nest == 0:
            return skip_group(toks, k)
        k += 1
    return k


def skip_group(toks, k):
    """The index after the bracket group opening at toks[k]."""
    depth = 0
    while k < len(toks):
        if toks[k] in "([{":
            depth += 1
        elif toks[k] in ")]}":
            depth -= 1
            if depth == 0:
                return k + 1
        k += 1
    return k


CFG_TEST = ["#", "[", "cfg", "(", "test", ")", "]"]


def use_paths(toks, k):
    """The paths of the use tree starting at toks[k]; returns (paths, the
    index after the closing `;`)."""
    paths = []

    def tree(k, prefix):
        path = list(prefix)
        while k < len(toks):
            t = toks[k]
            if t == "{":
                k += 1
                while toks[k] != "}":
                    k = tree(k, path)
                    if toks[k] == ",":
                        k += 1
                return k + 1
            if t == "*":
                paths.append(path)
                return k + 1
            if t in (",", "}", ";"):
                paths.append(path)
                return k
            if t == "as":
                paths.append(path)
                return k + 2
            if t != "::":
                if t == "self" and path:
                    pass  # `a::{self}` names `a` itself
                else:
                    path.append(t)
            k += 1
        return k

    try:
        k = tree(k, [])
    except IndexError:
        return paths, len(toks)
    while k < len(toks) and toks[k] != ";":
        k += 1
    return paths, k + 1


class Crate:
    """The modules of one crate: each file's module path and its inline
    children."""

    def __init__(self, src):
        self.src = src
        self.files = {}  # module path (tuple) -> file
        for dirpath, dirnames, filenames in os.walk(src):
            dirnames.sort()
            for f in sorted(filenames):
                if not f.endswith(".rs"):
                    continue
                rel = os.path.relpath(os.path.join(dirpath, f), src)
                parts = rel[:-3].split(os.sep)
                if parts[0] == "bin":
                    continue  # binaries are crates of their own
                if parts[-1] in ("lib", "main") and len(parts) == 1:
                    parts = []
                elif parts[-1] == "mod":
                    parts = parts[:-1]
                self.files.setdefault(tuple(parts), os.path.join(dirpath, f))
        self.inline = {}  # inline module path -> file that holds it
        self.test_only = set()  # module paths declared under #[cfg(test)]

    def library_files(self):
        """(module path, file) of every module that is not test-only."""
        for module, file in sorted(self.files.items()):
            if not any(module[:len(t)] == t for t in self.test_only):
                yield module, file

    def module_of(self, path):
        """The longest module prefix of `path` and the file holding it."""
        for end in range(len(path), -1, -1):
            p = tuple(path[:end])
            if p in self.inline:
                return p, self.inline[p]
            if p in self.files:
                return p, self.files[p]
        return None, None


def dependencies(crate, module, file):
    """The files that `file` (module path `module`) depends on, each with
    the first path that names it."""
    with open(file, encoding="utf-8") as fh:
        toks = tokens(fh.read())
    deps = {}
    # Modules open at this point: (module path, brace depth it closes at).
    stack = [(tuple(module), -1)]
    children = {}  # module path -> names of its child modules

    def child_names(mod):
        if mod not in children:
            names = {p[len(mod)] for p in crate.files if len(p) == len(mod) + 1 and p[:len(mod)] == mod}
            names |= {p[len(mod)] for p in crate.inline if len(p) == len(mod) + 1 and p[:len(mod)] == mod}
            children[mod] = names
        return children[mod]

    def resolve(path, here):
        """The absolute module path `path` names from module `here`."""
        if not path:
            return None
        if path[0] == "crate":
            return list(path[1:])
        if path[0] == "self":
            return list(here) + list(path[1:])
        if path[0] == "super":
            base = list(here)
            rest = list(path)
            while rest and rest[0] == "super":
                if not base:
                    return None
                base.pop()
                rest.pop(0)
            return base + rest
        if path[0] in child_names(tuple(here)):
            return list(here) + list(path)
        return None

    def add(path, here):
        target = resolve(path, here)
        if target is None:
            return
        module, f = crate.module_of(target)
        if module is None or module == tuple(here)[:len(module)]:
            return  # not a module of this crate, or an enclosing one
        if f is not None and f != file and f not in deps:
            deps[f] = "::".join(path)

    depth = 0
    k = 0
    while k < len(toks):
        t = toks[k]
        here = stack[-1][0]
        if toks[k:k + len(CFG_TEST)] == CFG_TEST:
            j = k + len(CFG_TEST)
            while j + 1 < len(toks) and toks[j] == "#" and toks[j + 1] == "[":
                j = skip_group(toks, j + 1)
            if toks[j:j + 1] == ["pub"]:
                j = skip_group(toks, j + 1) if toks[j + 1:j + 2] == ["("] else j + 1
            if toks[j:j + 1] == ["mod"] and j + 2 < len(toks) and toks[j + 2] == ";":
                crate.test_only.add(here + (toks[j + 1],))
            k = skip_item(toks, k + len(CFG_TEST))
            continue
        if t == "{":
            depth += 1
        elif t == "}":
            depth -= 1
            if depth == stack[-1][1]:
                stack.pop()
        elif t == "mod" and k + 2 < len(toks) and IDENT.fullmatch(toks[k + 1]) and toks[k + 2] == "{":
            inner = here + (toks[k + 1],)
            crate.inline.setdefault(inner, file)
            children.pop(here, None)
            stack.append((inner, depth))
            depth += 1
            k += 3
            continue
        elif t == "use" and (k == 0 or toks[k - 1] != "::"):
            paths, k = use_paths(toks, k + 1)
            for p in paths:
                add(p, here)
            continue
        elif IDENT.fullmatch(t) and k + 1 < len(toks) and toks[k + 1] == "::":
            prev = toks[k - 1] if k else ""
            if prev not in ("::", "$"):
                path = [t]
                j = k + 1
                while j + 1 < len(toks) and toks[j] == "::" and IDENT.fullmatch(toks[j + 1]):
                    path.append(toks[j + 1])
                    j += 2
                add(path, here)
                k = j
                continue
        k += 1
    return deps


def circles(crate):
    """Strongly connected sets of two or more files, each with a cycle."""
    graph = {}
    # Inline modules are found while reading: read every file once first.
    for module, file in crate.library_files():
        dependencies(crate, module, file)
    for module, file in crate.library_files():
        graph[file] = dependencies(crate, module, file)
    for deps in graph.values():
        for f in [f for f in deps if f not in graph]:
            del deps[f]  # a test-only file
    index, low, on, stack, found = {}, {}, set(), [], []
    counter = [0]

    def visit(v):  # Tarjan's algorithm
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    out = []
    for comp in found:
        out.append((comp, cycle(graph, comp)))
    return out


def cycle(graph, comp):
    """One cycle through the component's first file: [(file, path), ...]."""
    members = set(comp)
    start = comp[0]
    # Breadth-first from start's successors back to start.
    prev = {}
    frontier = [start]
    seen = {start}
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w not in members:
                    continue
                if w == start:
                    steps = [(v, graph[v][w])]
                    while v != start:
                        u = prev[v]
                        steps.append((u, graph[u][v]))
                        v = u
                    return list(reversed(steps))
                if w not in seen:
                    seen.add(w)
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return []


def long_files(root):
    """Library files over MAX_LINES lines whose first line gives no reason."""
    out = []
    base = os.path.join(root, "crates")
    for crate in sorted(os.listdir(base)) if os.path.isdir(base) else []:
        src = os.path.join(base, crate, "src")
        for dirpath, dirnames, filenames in os.walk(src):
            dirnames.sort()
            for f in sorted(filenames):
                if not f.endswith(".rs"):
                    continue
                path = os.path.join(dirpath, f)
                with open(path, encoding="utf-8") as fh:
                    lines = fh.read().splitlines()
                if len(lines) > MAX_LINES and not REASON.match(lines[0] if lines else ""):
                    out.append((path, len(lines)))
    return out


def main(argv):
    if len(argv) > 2 or (len(argv) == 2 and argv[1].startswith("-")):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    root = argv[1] if len(argv) == 2 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    root = os.path.normpath(root)
    base = os.path.join(root, "crates")
    if not os.path.isdir(base):
        print(f"check-layout: {base} is not a folder", file=sys.stderr)
        return 2
    rel = lambda p: os.path.relpath(p, root)
    n_circles = 0
    for name in sorted(os.listdir(base)):
        src = os.path.join(base, name, "src")
        if not os.path.isdir(src):
            continue
        for comp, steps in circles(Crate(src)):
            n_circles += 1
            print(f"import circle in {name}: {', '.join(rel(f) for f in comp)}")
            for f, path in steps:
                print(f"    {rel(f)} uses {path}")
    long = long_files(root)
    for path, n in long:
        print(f"long file: {rel(path)} has {n} lines (over {MAX_LINES}) and its first "
              f"line does not say why (\"//! Long because ...\")")
    print(f"layout: {n_circles} import circles, {len(long)} long files without a reason")
    return 1 if n_circles or long else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
