"""One ModelPool read from a file and judged holdable: what `kvbank sidecar --pool` and
`kvbank serve --pool` start from, so the two read the same manifest the same way and cannot
disagree on the pool they serve.

A pool whose architecture is `fromConfig.path` is resolved as `kvbank check` resolves it, from
the config.json beside the manifest: in a rank's pod that is the copy the operator judged,
rendered into the same ConfigMap as the manifest (kvbank.operator.model_config), so the layout
the webhook judged is the one the ranks count."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvbank.capacity import CapacityModel, Holdability, holdability
from kvbank.manifests import ManifestError, load_documents
from kvbank.modelpool import KvSlot, ModelPool, SpecError, parse_modelpool

if TYPE_CHECKING:
    from kvbank.capacity.configured import ConfiguredModel


class PoolFileError(ValueError):
    """The file does not hold exactly one ModelPool `kvbank check` accepts; the message says
    what is wrong and where."""


@dataclass(frozen=True)
class PoolFile:
    """A pool as a rank serves it: the spec, its layout from its config.json (None for a pool
    described by hand), and the verdict, whose page count is the pool's."""

    pool: ModelPool
    configured: ConfiguredModel | None
    held: Holdability

    @property
    def pages(self) -> int:
        return self.held.pages

    def capacity_model(self) -> CapacityModel:
        """What one request of this pool may need, label by label: the count its ledger makes."""
        if self.configured is None:
            return CapacityModel.from_pool(self.pool)
        limits = self.pool.limits
        return self.configured.pool.capacity_model(limits.max_seq_len, limits.max_tokens)

    @property
    def kv_slots(self) -> Mapping[str, KvSlot]:
        """The labels a request writes: kvSlots, or one per KV group of the layout."""
        if self.configured is None:
            return self.pool.kv_slots
        return self.configured.pool.kv_slots


def read_pool(path: str, server: str) -> PoolFile:
    """The one ModelPool in `path`, parsed, resolved and holdable; `server` names who refuses
    it (`this sidecar`, `the engine`) in the message."""
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
    configured = None
    if pool.from_config is not None:
        from kvbank.capacity.configured import ConfigSourceError, resolve_beside

        try:
            configured = resolve_beside(pool, path)
        except ConfigSourceError as exc:
            raise PoolFileError(f"--pool {where}: {exc}") from exc
    held = holdability(pool, configured)
    if not held.ok:
        raise PoolFileError(
            f"--pool {where}: `kvbank check` refuses this pool, so {server} will not serve "
            f"it: " + "; ".join(str(v) for v in held.violations)
        )
    return PoolFile(pool, configured, held)
