"""One ModelPool read from a file and judged holdable: what `kvbank sidecar --pool` and
`kvbank serve --pool` start from, so the two read the same manifest the same way and cannot
disagree on the pool they serve."""

from __future__ import annotations

from kvbank.capacity import holdability
from kvbank.manifests import ManifestError, load_documents
from kvbank.modelpool import ModelPool, SpecError, parse_modelpool


class PoolFileError(ValueError):
    """The file does not hold exactly one ModelPool `kvbank check` accepts; the message says
    what is wrong and where."""


def read_pool(path: str, server: str) -> ModelPool:
    """The one ModelPool in `path`, parsed and holdable; `server` names who refuses it (`this
    sidecar`, `the engine`) in the message."""
    try:
        docs = list(load_documents(path))
    except (OSError, ManifestError) as exc:
        raise PoolFileError(f"--pool {path}: {exc}") from exc
    if len(docs) != 1:
        raise PoolFileError(f"--pool {path}: expected one ModelPool document, found {len(docs)}")
    where, doc = docs[0]
    try:
        pool = parse_modelpool(doc)
    except SpecError as exc:
        raise PoolFileError(f"--pool {where}: " + "; ".join(str(e) for e in exc.errors)) from exc
    held = holdability(pool)
    if not held.ok:
        raise PoolFileError(
            f"--pool {where}: `kvbank check` refuses this pool, so {server} will not serve "
            f"it: " + "; ".join(str(v) for v in held.violations)
        )
    return pool
