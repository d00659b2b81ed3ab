"""Reading the project's YAML and JSON files: duplicate keys refused, naming
both lines, and the line of every key kept for error messages.

PyYAML and ``json`` read ``alice: 5`` then ``alice: 7`` as 7 without a word;
every file the project reads (limits, API and admin keys, scenarios,
workloads, the dashboards' thresholds) goes through ``load_yaml`` /
``load_json`` here instead, so a key given twice is an error. Pure logic:
no vLLM.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import yaml

#: A key path in a document: the mapping keys from the top, as constructed.
KeyPath = tuple[Any, ...]


@dataclass(frozen=True)
class Duplicate:
    """A key given twice in one mapping: ``keys`` is its path (the key last),
    ``first`` and ``again`` the 1-based lines of the two."""

    keys: KeyPath
    first: int
    again: int
    #: the two values as written (a mapping or a list shown as ``{...}`` / ``[...]``)
    values: tuple[str, str] = ("", "")

    def message(self, path: str, name: Callable[[Any], str] = str) -> str:
        """``FILE:LINE: KEY.PATH: duplicate key ...``; ``name`` spells a key
        (the API keys file shows a digest's first 8 hex digits only)."""
        where = ".".join(name(k) for k in self.keys)
        key = repr(name(self.keys[-1]))
        if not self.again:  # (JSON that YAML cannot read: no lines)
            return f"{path}: {where}: duplicate key {key} (given twice)"
        first, again = (f" ({v})" if v else "" for v in self.values)
        if self.first == self.again:
            return (f"{path}:{self.again}: {where}: duplicate key {key} twice on line "
                    f"{self.again}{first}{again and ' and' + again}")
        return (f"{path}:{self.again}: {where}: duplicate key {key} "
                f"at line {self.first}{first} and again at line {self.again}{again}")


class DuplicateKeyError(yaml.YAMLError, ValueError):
    """A document that gives a key twice in one mapping (every one named)."""

    def __init__(self, path: str, duplicates: list[Duplicate]) -> None:
        self.path = path
        self.duplicates = duplicates
        super().__init__("\n".join(d.message(path) for d in duplicates))


@dataclass
class Document:
    """A loaded document: ``data`` as ``yaml.safe_load`` gives it, ``lines``
    the 1-based line of each key path, ``duplicates`` the keys given twice
    (``data`` holds the last of each)."""

    path: str
    data: Any
    lines: dict[KeyPath, int] = field(default_factory=dict)
    duplicates: list[Duplicate] = field(default_factory=list)

    def line_of(self, keys: KeyPath) -> int:
        """The line of ``keys``, else of its nearest ancestor found (1 for
        the top)."""
        for n in range(len(keys), 0, -1):
            if keys[:n] in self.lines:
                return self.lines[keys[:n]]
        return 1

    def refuse_duplicates(self) -> Document:
        if self.duplicates:
            raise DuplicateKeyError(self.path, self.duplicates)
        return self


_MERGE = "tag:yaml.org,2002:merge"
#: libyaml's loader where PyYAML has it (several times faster on a large
#: limits file), else the pure-Python one; both safe, both keep marks
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


#: a key no path goes through (a complex one: PyYAML's safe loader refuses it)
_NO_KEY = object()


def _key(loader: Any, node: yaml.Node) -> Any:
    if not isinstance(node, yaml.ScalarNode):
        return _NO_KEY
    value = loader.construct_object(node, deep=True)
    try:
        hash(value)
    except TypeError:
        return _NO_KEY
    return value


def _shown(node: yaml.Node) -> str:
    if isinstance(node, yaml.ScalarNode):
        text = repr(node.value) if node.style in ("'", '"') else node.value
        return text if len(text) <= 60 else text[:57] + "..."
    return "{...}" if isinstance(node, yaml.MappingNode) else "[...]"


def _walk(loader: Any, node: yaml.Node, keys: KeyPath, doc: Document,
          walked: set[int]) -> None:
    if id(node) in walked:  # an alias of a node seen already (or a recursive one)
        return
    walked.add(id(node))
    if isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            _walk(loader, item, (*keys, index), doc, walked)
        return
    if not isinstance(node, yaml.MappingNode):
        return
    seen: dict[Any, tuple[int, yaml.Node]] = {}
    for key_node, value_node in node.value:
        if key_node.tag == _MERGE:  # ``<<: *base``: later keys override on purpose
            continue
        key = _key(loader, key_node)
        line = key_node.start_mark.line + 1
        if key is not _NO_KEY:
            if key in seen:
                first, first_value = seen[key]
                doc.duplicates.append(Duplicate((*keys, key), first, line,
                                                (_shown(first_value), _shown(value_node))))
            else:
                seen[key] = line, value_node
                doc.lines[(*keys, key)] = line
        _walk(loader, value_node, (*keys, key), doc, walked)


def load_yaml(text: str, path: str) -> Document:
    """``text`` (YAML, or JSON, which YAML reads) as a ``Document``: the data,
    the line of every key and the keys given twice (not refused here: see
    ``safe_load``). Raises ``yaml.YAMLError`` on text that is not YAML."""
    loader = _LOADER(text)
    try:
        node = loader.get_single_node()
        doc = Document(path, None)
        if node is not None:
            _walk(loader, node, (), doc, set())
            doc.data = loader.construct_document(node)
        return doc
    finally:
        loader.dispose()


def safe_load(text: str, path: str) -> Any:
    """``yaml.safe_load`` that refuses a key given twice: raises
    ``DuplicateKeyError`` (a ``yaml.YAMLError``) naming every one and both
    its lines."""
    return load_yaml(text, path).refuse_duplicates().data


def load_json(text: str, path: str, first_line: int = 1) -> Any:
    """``json.loads`` that refuses a key given twice (``DuplicateKeyError``,
    naming both lines where YAML can read the text too; ``first_line``: the
    line ``text`` starts on, for one line of a JSON Lines file); other
    errors as ``json.loads`` raises them."""
    found: list[Any] = []

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        data: dict[str, Any] = {}
        for key, value in items:
            if key in data:
                found.append(key)
            data[key] = value
        return data

    data = json.loads(text, object_pairs_hook=pairs)
    if found:
        try:
            doc = load_yaml(text, path)
        except yaml.YAMLError:
            doc = None
        shift = first_line - 1
        if doc is not None and doc.duplicates:
            raise DuplicateKeyError(path, [replace(d, first=d.first + shift, again=d.again + shift)
                                           for d in doc.duplicates])
        raise DuplicateKeyError(path, [Duplicate((k,), 0, 0) for k in found])
    return data
