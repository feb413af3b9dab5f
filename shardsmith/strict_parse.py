"""JSON and YAML parsing that refuses duplicate keys.

``json.loads`` and PyYAML's safe loader keep the last of two equal keys in one mapping without a
word, so a manifest with ``source`` written twice (the first holding junk) would read as intact.
Every JSON or YAML file the product reads (``pack.yaml``, rank manifests, ``plan.json``,
``config.json``, the safetensors index and headers) goes through here; a duplicate is named with
the key (and, in YAML, its line).

==========================  ===================================================================
function                    on a duplicate key
==========================  ===================================================================
:func:`parse_json`          returns the repeated keys beside the document (to collect problems)
:func:`loads_json`          raises :class:`DuplicateKeyError` (a ``ValueError``)
:func:`parse_header`        :func:`parse_json` for a safetensors header, fast when it has none
:func:`loads_yaml`          raises :class:`DuplicateKeyError`; ``yaml.YAMLError`` as PyYAML does
==========================  ===================================================================
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


def parse_json(data: str | bytes | bytearray) -> tuple[object, list[str]]:
    """``json.loads`` that also returns every key repeated in an object (the last copy is kept in
    the document, as ``json.loads`` keeps it), in document order.

    Raises:
        json.JSONDecodeError: not JSON (as ``json.loads``).
    """
    repeats: list[str] = []

    def note_repeats(pairs: list[tuple[str, object]]) -> dict:
        out: dict = {}
        for k, v in pairs:
            if k in out:
                repeats.append(k)
            out[k] = v
        return out

    return json.loads(data, object_pairs_hook=note_repeats), repeats


def loads_json(data: str | bytes | bytearray) -> object:
    """``json.loads`` that refuses a duplicate key in any object.

    Raises:
        DuplicateKeyError: listing every repeated key.
        json.JSONDecodeError: not JSON (as ``json.loads``).
    """
    doc, repeats = parse_json(data)
    if repeats:
        raise DuplicateKeyError([(k, None) for k in repeats])
    return doc


def parse_header(text: str) -> tuple[object, list[str]]:
    """:func:`parse_json` for a safetensors header: parsed once by the C parser, and again with the
    repeat check only when its entries and its ``"data_offsets"`` disagree in number (a repeated
    tensor name leaves fewer entries than offsets).

    Raises:
        json.JSONDecodeError: not JSON.
    """
    doc = json.loads(text)
    if isinstance(doc, dict) and len(doc) - ("__metadata__" in doc) != text.count('"data_offsets"'):
        return parse_json(text)
    return doc, []


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
