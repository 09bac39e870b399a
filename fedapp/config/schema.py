"""The schema: every run-config key (:class:`~fedapp.config.keys.Key`), read from the section dataclasses: the
built-in ones (:mod:`fedapp.config.sections`) and those a registered family brings (``Family.config``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

from fedapp.config.keys import KEY_METADATA, Key
from fedapp.config.sections import SECTION_CLASSES
from fedapp.registry import family_sections, registry_version

_TYPES: dict[str, type] = {"str": str, "int": int, "float": float, "bool": bool}


def _keys(classes: Mapping[str, Any]) -> dict[str, Key]:
    keys: dict[str, Key] = {}
    for attr, cls in classes.items():
        for f in dataclasses.fields(cls):
            spec = f.metadata[KEY_METADATA]
            name = f.name.replace("_", "-")
            kind = f.type if isinstance(f.type, type) else _TYPES[str(f.type)]  # with or without postponed annotations
            keys[name] = Key(name=name, type=kind, section=cls.SECTION, attr=attr, **spec)
    return keys


def section_attr(cls: Any) -> str:
    """The :class:`~fedapp.config.RunConfig` attribute (and builder parameter) of a family's own section."""
    return str(cls.SECTION).replace("-", "_")


class _Schema(Mapping[str, Key]):
    """Run-config key → Key: the built-in keys, then the keys of the registered families' own sections (rebuilt
    when a family is registered or removed)."""

    def __init__(self) -> None:
        self.builtin = _keys(SECTION_CLASSES)
        self._version = -1
        self._keys = self.builtin
        self._classes: dict[str, Any] = dict(SECTION_CLASSES)

    def _sync(self) -> None:
        version = registry_version()
        if version == self._version:
            return
        extra = {section_attr(cls): cls for cls in family_sections()}
        clash = sorted(set(extra) & set(SECTION_CLASSES))
        keys = _keys(extra)
        clash += sorted(set(keys) & set(self.builtin))
        if clash:
            raise ValueError(f"a registered family's run-config section redefines {clash[0]!r}, which exists already")
        self._keys, self._classes, self._version = {**self.builtin, **keys}, {**SECTION_CLASSES, **extra}, version

    def classes(self) -> dict[str, Any]:
        """Section attribute → section class, built-in and the families' own."""
        self._sync()
        return self._classes

    def __getitem__(self, name: str) -> Key:
        self._sync()
        return self._keys[name]

    def __iter__(self) -> Iterator[str]:
        self._sync()
        return iter(self._keys)

    def __len__(self) -> int:
        self._sync()
        return len(self._keys)

    def __contains__(self, name: object) -> bool:
        self._sync()
        return name in self._keys


#: run-config key → Key, in the order of the sections and their fields (docs/config.md, pyproject.toml)
SCHEMA = _Schema()
