#!/usr/bin/env python3
"""Write the generated tables of README.md and the manual (docs/*.md) from nrvna.py's own tables
(SETTINGS, PARAMS, EXIT_CODES, FAILURE_CODES), between the marker lines

    <!-- BEGIN GENERATED: NAME (scripts/readme_tables.py) -->
    <!-- END GENERATED: NAME -->

wherever each section lives (the settings in docs/configuration.md, say). Every table must have
a section in some file. `--check` changes nothing and exits 1 when a file differs (the test
suite runs it).
"""

from __future__ import annotations

import glob
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
import nrvna  # noqa: E402


def documents() -> list[str]:
    """README.md and the manual's pages, the files that may hold generated sections."""
    return [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))


def section(name: str) -> re.Pattern[str]:
    return re.compile(rf"(<!-- BEGIN GENERATED: {re.escape(name)} \([^)]*\) -->\n).*?(<!-- END GENERATED: "
                      rf"{re.escape(name)} -->)",
                      re.S)


def render(text: str, found: set[str] | None = None) -> str:
    """``text`` with every generated section it holds replaced by its table; the names of the
    sections found are added to ``found``."""
    for name, table in nrvna.markdown_tables().items():
        pattern = section(name)
        if pattern.search(text):
            if found is not None:
                found.add(name)
            text = pattern.sub(lambda m, table=table: m.group(1) + table + "\n" + m.group(2), text)
    return text


def main(argv: list[str]) -> int:
    found: set[str] = set()
    changed = []
    for path in documents():
        with open(path, encoding="utf-8") as handle:
            current = handle.read()
        wanted = render(current, found)
        if wanted != current:
            changed.append((path, wanted))
    missing = sorted(set(nrvna.markdown_tables()) - found)
    if missing:
        print(f"readme_tables: no generated section {', '.join(map(repr, missing))} in README.md or docs/*.md",
              file=sys.stderr)
        return 1
    if "--check" in argv:
        if changed:
            names = ", ".join(os.path.relpath(path, ROOT) for path, _ in changed)
            print(f"readme_tables: the generated tables in {names} differ from nrvna.py; run "
                  "python scripts/readme_tables.py", file=sys.stderr)
            return 1
        return 0
    for path, wanted in changed:
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(wanted)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
