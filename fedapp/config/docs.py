"""docs/config.md's key table, generated from the schema (``python -m fedapp.config --write-docs``)."""

from __future__ import annotations

from fedapp.config.schema import SCHEMA


def markdown_table() -> str:
    """The README's config reference, generated from the schema."""
    lines = ["| key | default | meaning |", "|---|---|---|"]
    for section in dict.fromkeys(k.section for k in SCHEMA.values()):
        for key in SCHEMA.values():
            if key.section == section:
                doc = key.doc + (f" One of: {', '.join(key.choices)}." if key.choices and len(key.choices) > 3 else "")
                lines.append(f"| `{key.name}` | `{key.default!r}` | {doc} |")
    return "\n".join(lines)


TABLE_START, TABLE_END = "<!-- config-table:start -->", "<!-- config-table:end -->"
#: the generated reference (``python -m fedapp.config --write-docs``)
CONFIG_DOC = "docs/config.md"


def doc_with_table(doc: str) -> str:
    """``doc`` with the generated config table between the markers."""
    head, _, rest = doc.partition(TABLE_START)
    _, _, tail = rest.partition(TABLE_END)
    return f"{head}{TABLE_START}\n{markdown_table()}\n{TABLE_END}{tail}"

