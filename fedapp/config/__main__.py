"""``python -m fedapp.config``: print the key table; ``--write-docs`` rewrites it in docs/config.md."""

import sys
from pathlib import Path

from fedapp.config.docs import CONFIG_DOC, doc_with_table, markdown_table

if "--write-docs" in sys.argv:
    path = Path(__file__).resolve().parents[2] / CONFIG_DOC
    path.write_text(doc_with_table(path.read_text(encoding="utf-8")), encoding="utf-8")
else:
    print(markdown_table())
