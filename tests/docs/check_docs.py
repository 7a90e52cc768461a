#!/usr/bin/env python3
"""Checks that the documentation says only what compiles.

Every ```cpp block in the project's Markdown files is compiled, verbatim, as one translation
unit (-std=c++20 -fsyntax-only, warnings as errors) against the library's headers, and every
<bspflow/...> include path the Markdown names must exist. A block that is not meant to
compile must not be fenced as cpp (use ```text). Exits 0 when everything holds, 1 with a
report naming the file, the line and the compiler's words otherwise.

  check_docs.py --root SRC --compiler c++ [--compiler-arg ARG ...] --include DIR [...]
"""
import argparse
import concurrent.futures
import os
import pathlib
import re
import subprocess
import sys
import tempfile

SKIP_DIRS = {".git", "subprojects", "node_modules"}
FENCE = re.compile(r"^(\s*)```\s*([^\s`]*)")
INCLUDE = re.compile(r"<(bspflow/[A-Za-z0-9_/.]+\.hpp)>")


def markdown_files(root):
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS and not d.startswith("build")]
        for name in filenames:
            if name.endswith(".md"):
                yield pathlib.Path(dirpath) / name


CPP_LANGS = ("cpp", "c++", "cc", "cxx", "hpp", "h")


def cpp_blocks(path, problems, rel):
    """(first line number, text) of every ```cpp block. Any line starting with ``` (after
    spaces) opens or closes a fence, so an unusual opener cannot make the parser lose its
    place; an indented or unclosed cpp fence is reported as a problem (it would not be
    compiled)."""
    blocks, lines, start, lang = [], [], None, None
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        m = FENCE.match(line)
        if m is None:
            if start is not None:
                lines.append(line)
            continue
        if start is None:
            start, lang, lines = number + 1, m.group(2).lower(), []
            if lang in CPP_LANGS and (m.group(1) or lang != "cpp"):
                problems.append(f"{rel}:{number}: a C++ block must open with ```cpp at the start "
                                f"of the line, to be compiled (found {line.strip()!r})")
        else:
            if lang == "cpp" and not m.group(1):
                blocks.append((start, "\n".join(lines) + "\n"))
            start = None
    if start is not None:
        problems.append(f"{rel}:{start - 1}: a fence is never closed")
    return blocks


def compile_block(compiler, args, includes, source):
    with tempfile.NamedTemporaryFile("w", suffix=".cpp", delete=False) as f:
        f.write(source)
        name = f.name
    try:
        cmd = compiler + args + ["-std=c++20", "-fsyntax-only", "-Wall", "-Wextra", "-Werror"]
        cmd += ["-I" + d for d in includes] + [name]
        r = subprocess.run(cmd, capture_output=True, text=True)
        return r.returncode, (r.stdout + r.stderr).replace(name, "<snippet>")
    finally:
        os.unlink(name)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", required=True)
    ap.add_argument("--compiler", required=True, action="append")
    ap.add_argument("--compiler-arg", action="append", default=[])
    ap.add_argument("--include", action="append", default=[])
    ap.add_argument("--jobs", type=int, default=2)
    opts = ap.parse_args()
    root = pathlib.Path(opts.root)
    failures, jobs, paths_checked = [], [], 0
    files = sorted(markdown_files(root))
    with concurrent.futures.ThreadPoolExecutor(max_workers=opts.jobs) as pool:
        for md in files:
            rel = md.relative_to(root)
            text = md.read_text(encoding="utf-8")
            for number, line in enumerate(text.splitlines(), 1):
                for inc in INCLUDE.findall(line):
                    paths_checked += 1
                    if not any((pathlib.Path(d) / inc).is_file() for d in opts.include):
                        failures.append(f"{rel}:{number}: <{inc}> does not exist")
            found = cpp_blocks(md, failures, rel)
            if found:
                print(f"{rel}: {len(found)} cpp block(s)")
            for start, source in found:
                jobs.append((rel, start, pool.submit(compile_block, opts.compiler, opts.compiler_arg,
                                                     opts.include, source)))
        for rel, start, future in jobs:
            code, output = future.result()
            if code != 0:
                failures.append(f"{rel}:{start}: the cpp block does not compile:\n{output}")
    print(f"{len(files)} Markdown files, {len(jobs)} cpp blocks compiled, "
          f"{paths_checked} include paths checked")
    if failures:
        print("\n".join(failures))
        print(f"{len(failures)} problem(s)")
        return 1
    if not jobs:
        print("no cpp block found: the check would pass vacuously")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
