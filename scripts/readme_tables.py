#!/usr/bin/env python3
"""Write the README's generated tables from nrvna.py's own tables (SETTINGS, PARAMS,
EXIT_CODES, FAILURE_CODES), between the marker lines

    <!-- BEGIN GENERATED: NAME (scripts/readme_tables.py) -->
    <!-- END GENERATED: NAME -->

`--check` changes nothing and exits 1 when the README differs (the test suite runs it).
"""

from __future__ import annotations

import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
import nrvna  # noqa: E402

README = os.path.join(os.path.dirname(HERE), "README.md")


def render(text: str) -> str:
    """``text`` with every generated section replaced by its table; a missing section is an error."""
    for name, table in nrvna.markdown_tables().items():
        pattern = re.compile(rf"(<!-- BEGIN GENERATED: {re.escape(name)} \([^)]*\) -->\n).*?(<!-- END GENERATED: {re.escape(name)} -->)",
                             re.S)
        if not pattern.search(text):
            raise SystemExit(f"readme_tables: README.md has no generated section {name!r}")
        text = pattern.sub(lambda m, table=table: m.group(1) + table + "\n" + m.group(2), text)
    return text


def main(argv: list[str]) -> int:
    with open(README, encoding="utf-8") as handle:
        current = handle.read()
    wanted = render(current)
    if "--check" in argv:
        if wanted != current:
            print("readme_tables: README.md's generated tables differ from nrvna.py; run "
                  "python scripts/readme_tables.py", file=sys.stderr)
            return 1
        return 0
    if wanted != current:
        with open(README, "w", encoding="utf-8") as handle:
            handle.write(wanted)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
