#!/usr/bin/env python3
"""The rooms keep to their floors.

Reads the room table the build declares (meson.build's `rooms`, passed as arguments
`name=root:below,below`) and every C++ file git tracks, then checks each #include of a
bspflow header:

- a room's file (its sources and headers) includes only its own room and the rooms below it;
- a room's detail/ is included only by that room (base's detail/ serves every room);
- a room's internal/ is included only by the rooms above it, and by the room itself;
- a test under tests/<room>/ may include that room's detail/ (it tests the machinery); every
  other file outside the rooms (examples, benchmarks, other tests) includes only public
  headers and base's detail/.

Prints one line per include that breaks a rule, naming the file, the line, the include and
the rule, and exits 1; exits 0 with a one-line summary when every include keeps the rules.

    python3 tests/docs/check_includes.py --root . base=feeds/base: feeds=feeds/queues:base ...
"""

import argparse
import re
import subprocess
import sys
from pathlib import Path

INCLUDE = re.compile(r'^\s*#\s*include\s*[<"](bspflow/([a-z_]+)/(?:(detail|internal)/)?[^>"]+)[>"]')
SOURCE = re.compile(r"\.(hpp|cpp|h|cc|hpp\.in)$")


def parse_table(entries):
    """name=root:below,... -> {name: (root, set(below))}"""
    rooms = {}
    for entry in entries:
        name, _, rest = entry.partition("=")
        root, _, below = rest.partition(":")
        if not name or not root:
            sys.exit(f"check_includes: bad room entry '{entry}': expected name=root:below,...")
        rooms[name] = (root, {b for b in below.split(",") if b})
    return rooms


def room_of(path, rooms):
    """The room whose include root holds `path`, or None (the longest root wins)."""
    best = None
    for name, (root, _) in rooms.items():
        if path.startswith(root + "/") and (best is None or len(root) > len(rooms[best][0])):
            best = name
    return best


def tested_room(path, rooms):
    """tests/<room>/...: the room a test file tests, or None."""
    parts = path.split("/")
    if len(parts) >= 3 and parts[0] == "tests" and parts[1] in rooms:
        return parts[1]
    return None


def check(target, kind, owner, rooms, tested):
    """The rule `#include <target>` in `path` breaks, or None."""
    if target not in rooms:
        return f"bspflow/{target}/ is no room (rooms: {', '.join(rooms)})"
    if owner is not None:
        below = rooms[owner][1]
        if target != owner and target not in below:
            return (f"room '{owner}' includes room '{target}', which is not below it "
                    f"(below '{owner}': {', '.join(sorted(below)) or 'nothing'})")
        if kind == "detail" and target not in (owner, "base"):
            return f"room '{owner}' includes the detail/ of room '{target}', which is private to it"
        return None
    # Outside the rooms: examples, benchmarks, tests.
    if kind == "detail" and target not in ("base", tested):
        return f"detail/ of room '{target}' is private to it (only its own tests may include it)"
    if kind == "internal" and target != tested:
        return f"internal/ of room '{target}' is for the rooms above it, not for users"
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default=".", help="the source tree (default: .)")
    ap.add_argument("rooms", nargs="+", help="name=root:below,below (meson.build's table)")
    args = ap.parse_args()
    rooms = parse_table(args.rooms)
    root = Path(args.root)
    files = subprocess.run(["git", "-C", str(root), "ls-files"], check=True, capture_output=True,
                           text=True).stdout.split()
    problems, checked = [], 0
    for path in files:
        if not SOURCE.search(path) or path.startswith("subprojects/"):
            continue
        owner = room_of(path, rooms)
        tested = tested_room(path, rooms)
        try:
            lines = (root / path).read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError as e:
            problems.append(f"{path}: cannot read: {e}")
            continue
        for lineno, line in enumerate(lines, 1):
            m = INCLUDE.match(line)
            if not m:
                continue
            checked += 1
            why = check(m.group(2), m.group(3), owner, rooms, tested)
            if why:
                problems.append(f"{path}:{lineno}: #include <{m.group(1)}>: {why}")
    for p in problems:
        print(p)
    if problems:
        print(f"include rules: {len(problems)} of {checked} includes break them")
        return 1
    print(f"include rules: {checked} includes of bspflow headers, all keep to their floors")
    return 0


if __name__ == "__main__":
    sys.exit(main())
