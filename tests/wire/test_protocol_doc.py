"""docs/protocol.md, which the code cites, lists every message with its tag and its fields."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from pccl.wire import messages as m

DOC = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"


def test_every_message_is_in_the_table_with_its_tag_and_fields() -> None:
    text = DOC.read_text()
    rows = {
        match.group(2): (int(match.group(1)), match.group(3))
        for match in re.finditer(r"^\| *(\d+) \| `(\w+)` \|[^|]*\|(.*)\|$", text, re.MULTILINE)
    }
    registry = m.message_types()
    assert sorted(rows) == sorted(cls.__name__ for cls in registry.values())
    for tag, cls in registry.items():
        doc_tag, fields = rows[cls.__name__]
        assert doc_tag == tag, cls.__name__
        for field in dataclasses.fields(cls):  # type: ignore[arg-type]
            assert f"`{field.name}`" in fields, f"{cls.__name__}.{field.name} is not documented"


def test_the_named_rows_are_documented_field_by_field() -> None:
    text = DOC.read_text()
    for row in (m.PeerRow, m.CollectiveDescriptor):
        line = next(ln for ln in text.splitlines() if ln.startswith(f"- `{row.__name__}`"))
        i = text.index(line)
        block = text[i : text.index("\n\n", i)]
        for name in row._fields:
            assert f"{name}: " in block, f"{row.__name__}.{name}"
