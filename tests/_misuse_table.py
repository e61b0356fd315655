"""docs/MISUSE.md read as data: the row parser, the message matcher and `assert_row`.

The table's rows are `| ID | Misuse | Exception | Message | Checked |`. The message is a code span in which
`{...}` stands for any text; it must match the whole first line of the exception's message. Used by
tests/test_misuse_table.py; the triggers are in tests/_misuse_triggers_*.py.
"""

from __future__ import annotations

import pathlib
import re

import pytest

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "MISUSE.md"
CHECKED = ("cpu", "cuda", "2 gpus", "manual")


def parse_table(text: str):
    """Rows of every table whose header starts with `| ID |`: dicts of id, misuse, exception, message,
    checked."""
    rows, in_table = [], False
    for line in text.splitlines():
        if line.startswith("| ID |"):
            in_table = True
            continue
        if not line.startswith("|"):
            in_table = False
            continue
        if not in_table or set(line) <= set("|- "):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        assert len(cells) == 5, f"malformed row ({len(cells)} cells): {line}"
        rid, misuse, exc, msg, checked = cells
        assert rid.startswith("`") and rid.endswith("`"), line
        assert exc.startswith("`") and exc.endswith("`"), line
        assert msg.startswith("`` ") and msg.endswith(" ``"), f"message must be a ``...`` code span: {line}"
        rows.append(dict(id=rid.strip("`"), misuse=misuse, exception=exc.strip("`"), message=msg[3:-3],
                         checked=checked))
    return rows


def message_regex(template: str) -> re.Pattern:
    parts = re.split(r"\{[^{}]*\}", template)
    return re.compile(".+?".join(re.escape(p) for p in parts), re.DOTALL)


ROWS = parse_table(DOC.read_text())
BY_ID = {r["id"]: r for r in ROWS}


def assert_row(row_id: str, trigger) -> None:
    row = BY_ID[row_id]
    with pytest.raises(Exception) as info:
        trigger()
    exc = info.value
    assert type(exc).__name__ == row["exception"], (
        f"{row_id}: expected {row['exception']}, got {type(exc).__name__}: {exc}")
    first_line = str(exc).split("\n")[0]
    assert message_regex(row["message"]).fullmatch(first_line), (
        f"{row_id}: message\n  {first_line!r}\ndoes not match the table's\n  {row['message']!r}")



def ids(checked):
    return [r["id"] for r in ROWS if r["checked"] == checked]
