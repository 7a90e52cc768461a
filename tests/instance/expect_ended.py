#!/usr/bin/env python3
"""Runs a command that must end with a non-zero status, within a time limit, printing a text.

Usage: expect_ended.py TEXT SECONDS COMMAND...
"""
import subprocess
import sys


def main() -> int:
    text, seconds, command = sys.argv[1], float(sys.argv[2]), sys.argv[3:]
    try:
        run = subprocess.run(command, capture_output=True, text=True, timeout=seconds)
    except subprocess.TimeoutExpired:
        print(f"still running after {seconds} s: it should have ended")
        return 1
    output = run.stdout + run.stderr
    print(output)
    if run.returncode == 0:
        print("exit status 0: it should have ended with an error")
        return 1
    if text not in output:
        print(f"its output does not say '{text}'")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
