"""The schema: every run-config key (:class:`~fedapp.config.keys.Key`), read from the section dataclasses."""

from __future__ import annotations

import dataclasses

from fedapp.config.keys import KEY_METADATA, Key
from fedapp.config.sections import SECTION_CLASSES

_TYPES: dict[str, type] = {"str": str, "int": int, "float": float, "bool": bool}


def _keys() -> dict[str, Key]:
    keys: dict[str, Key] = {}
    for attr, cls in SECTION_CLASSES.items():
        for f in dataclasses.fields(cls):
            spec = f.metadata[KEY_METADATA]
            name = f.name.replace("_", "-")
            keys[name] = Key(name=name, type=_TYPES[str(f.type)], section=cls.SECTION, attr=attr, **spec)
    return keys


#: run-config key → Key, in the order of the sections and their fields (docs/config.md, pyproject.toml)
SCHEMA: dict[str, Key] = _keys()
