"""JSON and YAML parsing that refuses duplicate keys.

``json.loads`` and PyYAML's safe loader keep the last of two equal keys in one mapping without a
word, so a manifest with ``source`` written twice (the first holding junk) would read as intact.
Every JSON or YAML file the product reads (``pack.yaml``, rank manifests, ``plan.json``,
``config.json``, the safetensors index and headers) goes through here; a duplicate is named with
the key (and, in YAML, its line).

==================  ===========================================================
function            raises on a duplicate key
==================  ===========================================================
:func:`loads_json`  :class:`DuplicateKeyError` (a ``ValueError``)
:func:`loads_yaml`   :class:`DuplicateKeyError`; ``yaml.YAMLError`` as PyYAML does
==================  ===========================================================
"""

from __future__ import annotations

import json

import yaml

__all__ = ["DuplicateKeyError", "loads_json", "loads_yaml"]


class DuplicateKeyError(ValueError):
    """Mappings hold the same key twice; every repeat in the document is listed.

    Attributes:
        keys: each repeated key with its second occurrence's 1-based line (YAML) or ``None`` (JSON),
            in document order.
    """

    def __init__(self, keys: list[tuple[object, int | None]]) -> None:
        self.keys = keys
        named = ", ".join(f"{k!r}" + (f" (line {line})" if line is not None else "") for k, line in keys)
        super().__init__(f"duplicate key{'s' if len(keys) > 1 else ''} {named}: "
                         f"a key may appear once in a mapping")


def loads_json(data: str | bytes | bytearray) -> object:
    """``json.loads`` that refuses a duplicate key in any object.

    Raises:
        DuplicateKeyError: listing every repeated key.
        json.JSONDecodeError: not JSON (as ``json.loads``).
    """
    repeats: list[tuple[object, int | None]] = []

    def no_duplicates(pairs: list[tuple[str, object]]) -> dict:
        out: dict = {}
        for k, v in pairs:
            if k in out:
                repeats.append((k, None))
            out[k] = v
        return out

    doc = json.loads(data, object_pairs_hook=no_duplicates)
    if repeats:
        raise DuplicateKeyError(repeats)
    return doc


_BASE = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _StrictLoader(_BASE):  # type: ignore[misc,valid-type]
    """The safe loader (libyaml's when built) noting every repeated key of a mapping."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                repeated = key in seen
            except TypeError:  # an unhashable key: PyYAML's own error names it below
                break
            if repeated:
                self.repeats.append((key, key_node.start_mark.line + 1))
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def loads_yaml(text: str) -> object:
    """``yaml.safe_load`` (libyaml's parser when available) that refuses a duplicate key.

    Raises:
        DuplicateKeyError: listing every repeated key with its line.
        yaml.YAMLError: not YAML (as PyYAML).
    """
    loader = _StrictLoader(text)
    loader.repeats = []
    try:
        doc = loader.get_single_data()
    finally:
        loader.dispose()
    if loader.repeats:
        raise DuplicateKeyError(sorted(loader.repeats, key=lambda kv: kv[1]))
    return doc
