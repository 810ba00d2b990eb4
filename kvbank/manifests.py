"""Reading YAML manifests with bounded cost: `kvbank check` and `kvbank sidecar --pool` read files
a user hands them, and a hostile or careless file must cost a bounded amount of time and memory
before it is refused with a message that says which limit it passed.

The limits, and why each is needed:

- the file's bytes (`MAX_FILE_BYTES`): PyYAML's pure-Python reader takes about half a second per
  megabyte; a ModelPool is a few KiB, and the API server stores objects of at most 1.5 MiB;
- documents per file (`MAX_DOCUMENTS`);
- nesting depth (`MAX_DEPTH`): the composer recurses once per level, so 20,000 nested `[` end
  in a RecursionError rather than a message;
- nodes per document once aliases are expanded (`MAX_NODES`): nine levels of nine aliases are
  a few hundred bytes that expand to 387 million values, which any reader walking the result
  (an error message quoting it, a JSON dump) would have to walk.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import yaml

from kvbank.fields import MAX_DEPTH, MAX_VALUES, quote

MAX_FILE_BYTES = 2 * 1024 * 1024
MAX_DOCUMENTS = 256
MAX_NODES = MAX_VALUES  # the parser refuses a bigger document anyway (kvbank.fields.check_size)

_UTF16_32_BOMS = {
    b"\xff\xfe\x00\x00": "UTF-32",
    b"\x00\x00\xfe\xff": "UTF-32",
    b"\xff\xfe": "UTF-16",
    b"\xfe\xff": "UTF-16",
}


class ManifestError(Exception):
    """A file that cannot be read as YAML manifests; the message names the file and the fix."""


class InputLimit(yaml.YAMLError):
    """A document past one of this module's limits."""


class DuplicateKey(yaml.YAMLError):
    """A mapping that names a key twice: YAML leaves it undefined, PyYAML keeps the last value,
    and kubectl refuses the file. Read as PyYAML does, a manifest would check as one thing and
    apply as another (or not at all)."""


class BoundedLoader(yaml.SafeLoader):
    """A SafeLoader that refuses documents nested deeper than MAX_DEPTH or expanding to more than
    MAX_NODES nodes, counting an alias as the size of what it names; and reads YAML 1.2 floats:
    `8.03e9` is a number to kubectl, so it must be one here too (YAML 1.1, PyYAML's default,
    reads it as a string)."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0
        self._nodes = 0
        self._sizes: dict[int, int] = {}  # id(anchored node) -> its expanded node count

    def compose_document(self) -> Any:
        self._nodes = 0
        self._sizes.clear()
        return super().compose_document()

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            node = super().compose_node(parent, index)
            self._count(self._sizes.get(id(node), 1), event)
            return node
        if self._depth >= MAX_DEPTH:
            raise InputLimit(
                f"nesting deeper than {MAX_DEPTH} levels at {_where(event)}; a manifest "
                f"needs a handful"
            )
        before = self._nodes
        self._depth += 1
        try:
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
        self._count(1, event)
        if event.anchor is not None:
            self._sizes[id(node)] = self._nodes - before
        return node

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        seen: dict[Any, Any] = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == MERGE_TAG:
                continue  # a merge (<<) may be overridden by the mapping's own keys
            key = self.construct_object(key_node)
            if key in seen:
                first = seen[key].start_mark.line + 1
                raise DuplicateKey(
                    f"key {quote(key)} appears twice in one mapping, on line {first} and line "
                    f"{key_node.start_mark.line + 1}; kubectl refuses a duplicate key: keep one"
                )
            seen[key] = key_node
        return super().construct_mapping(node, deep)

    def _count(self, nodes: int, event: Any) -> None:
        self._nodes += nodes
        if self._nodes > MAX_NODES:
            raise InputLimit(
                f"a document expands to more than {MAX_NODES} values (aliases counted as what "
                f"they repeat) by {_where(event)}; write the values out instead of aliasing them"
            )


MERGE_TAG = "tag:yaml.org,2002:merge"

BoundedLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\d[\d_]*\.?\d*(?:[eE][-+]?\d+)|\.\d+(?:[eE][-+]?\d+)?)$"),
    list("-+0123456789."),
)


def _where(event: Any) -> str:
    mark = event.start_mark
    return f"line {mark.line + 1}, column {mark.column + 1}"


def _read_bounded(stream: BinaryIO, path: str) -> bytes:
    data = stream.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise ManifestError(
            f"{path}: larger than the {MAX_FILE_BYTES // (1024 * 1024)} MiB kvbank reads from a "
            f"manifest file; a ModelPool is a few KiB, so split the file or remove what is not "
            f"a manifest"
        )
    return data


def decode(data: bytes, path: str) -> str:
    """UTF-8 text (a UTF-8 byte-order mark allowed), or a ManifestError saying what it is."""
    for bom, name in _UTF16_32_BOMS.items():
        if data.startswith(bom):
            raise ManifestError(f"{path}: is {name}-encoded; save it as UTF-8")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise ManifestError(
            f"{path}: is not UTF-8 (byte 0x{data[exc.start]:02x} on line {line} cannot be "
            f"decoded); save it as UTF-8"
        ) from None


def read_text(path: str) -> str:
    """The file's text ('-': stdin), refused past MAX_FILE_BYTES or when it is not UTF-8."""
    try:
        if path == "-":
            data = _read_bounded(sys.stdin.buffer, "stdin")
        else:
            with Path(path).open("rb") as stream:
                data = _read_bounded(stream, path)
    except OSError as exc:
        raise ManifestError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    return decode(data, path)


def parse_documents(text: str, path: str) -> list[Any]:
    """Every YAML document in `text` (None for an empty one), within this module's limits."""
    docs: list[Any] = []
    try:
        for doc in yaml.load_all(text, Loader=BoundedLoader):  # a SafeLoader subclass
            if len(docs) == MAX_DOCUMENTS:
                raise ManifestError(
                    f"{path}: more than {MAX_DOCUMENTS} YAML documents; split the file"
                )
            docs.append(doc)
    except (InputLimit, DuplicateKey) as exc:
        raise ManifestError(f"{path}: {exc}") from None
    except yaml.YAMLError as exc:
        raise ManifestError(f"{path}: not valid YAML: {exc}") from None
    except (ValueError, RecursionError) as exc:  # e.g. an integer of more than 4,300 digits
        raise ManifestError(f"{path}: a value cannot be read: {str(exc)[:200]}") from None
    return docs


def load_documents(path: str) -> Iterator[tuple[str, Any]]:
    """(where, document) for every non-empty YAML document in a file ('-': stdin)."""
    for index, doc in enumerate(parse_documents(read_text(path), path)):
        if doc is not None:
            yield f"{path}#{index + 1}", doc
