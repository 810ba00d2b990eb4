"""`kvbank check FILE...`: the same holdability rules the operator's webhook runs.

Exit codes: 0 every pool is holdable, 1 some pool violates a rule, 2 a file cannot be read as
ModelPool manifests.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from kvbank.capacity import CapacityModel, holdability, worst_case
from kvbank.deployment import parse_deployment
from kvbank.fields import quote
from kvbank.manifests import ManifestError, load_documents
from kvbank.modelpool import KIND, ModelPool, SpecError, parse_modelpool
from kvbank.service_class import ServiceClass

if TYPE_CHECKING:
    from kvbank.capacity.configured import ConfiguredModel

__all__ = ["ManifestError", "load_documents", "run"]  # the sidecar's --pool reads the same way


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "files",
        nargs="+",
        metavar="FILE",
        help="YAML files with one or more ModelPool documents ('-' for stdin)",
    )


def default_class(pool: ModelPool) -> str:
    """The class a request that names no service_tier gets. The concurrency above is the
    strict guarantee whatever the class: best-effort requests run on what strict ones leave."""
    adm = pool.admission
    if adm.default_class is ServiceClass.STRICT:
        return "default class strict (service_tier flex asks for best-effort)"
    return (
        f"default class best-effort (preempted at most {adm.max_preemptions} times, "
        f"{adm.victim.value} first; service_tier priority asks for strict)"
    )


def run(args: argparse.Namespace) -> int:
    worst_exit = 0
    for path in args.files:
        try:
            docs = list(load_documents(path))
        except ManifestError as exc:
            print(f"error: {exc}", file=sys.stderr)
            worst_exit = 2
            continue
        if not docs:
            print(f"error: {path}: no YAML documents", file=sys.stderr)
            worst_exit = 2
        for where, doc in docs:
            if isinstance(doc, dict) and doc.get("kind") not in (KIND, None):
                kind = quote(doc.get("kind"))
                print(f"error: {where}: kind {kind} is not {KIND}", file=sys.stderr)
                worst_exit = 2
                continue
            errors = []
            try:
                pool = parse_modelpool(doc)
            except SpecError as exc:
                errors += exc.errors
            try:  # the pod-facing fields, as the webhook reads them
                parse_deployment(doc)
            except SpecError as exc:
                errors += exc.errors
            if errors:
                print(f"error: {where}: not a valid {KIND}:", file=sys.stderr)
                for err in errors:
                    print(f"  - {err}", file=sys.stderr)
                worst_exit = 2
                continue
            try:
                configured = _resolve(pool, path)
            except ValueError as exc:  # ConfigSourceError: names the field
                print(f"error: {where}: {exc}", file=sys.stderr)
                worst_exit = 2
                continue
            result = holdability(pool, configured)
            name = f"{pool.namespace}/{pool.name}"
            if result.ok:
                print(
                    f"OK {where} {name}: worst-case request {result.worst_request_pages} "
                    f"pages; the pool ({result.pages} pages) holds {result.worst_concurrency} "
                    f"worst-case requests at once; {default_class(pool)}"
                )
                for line in _group_lines(pool, configured):
                    print(f"  {line}")
            else:
                print(f"FAIL {where} {name}: {len(result.violations)} violation(s):")
                for violation in result.violations:
                    print(f"  - {violation}")
                for line in _group_lines(pool, configured):
                    print(f"  {line}")
                worst_exit = max(worst_exit, 1)
    return worst_exit


def _resolve(pool: ModelPool, manifest: str) -> ConfiguredModel | None:
    """The pool's layout from its config.json, a path relative to the manifest's folder."""
    if pool.from_config is None:
        return None
    from kvbank.capacity.configured import resolve_beside  # only pools that name a config pay

    return resolve_beside(pool, manifest)


def _group_lines(pool: ModelPool, configured: ConfiguredModel | None) -> list[str]:
    """Per KV group of a configured pool: its layers, its rule and the worst-case request's
    pages there."""
    if configured is None:
        return []
    layout = configured.pool
    model: CapacityModel = layout.capacity_model(pool.limits.max_seq_len, pool.limits.max_tokens)
    _, worst = worst_case(model)
    lines = [
        f"{layout.model_type}: {len(layout.groups)} KV group(s), {layout.page_bytes} bytes a "
        f"page of {layout.page_size} tokens ({layout.layers_per_group} layers x "
        f"{layout.layer_page_bytes} bytes), weights "
        f"{configured.weights_bytes_per_rank / 2**30:.2f} GiB per rank"
    ]
    for group in layout.groups:
        lines.append(
            f"group {group.label}: {group.layers} layers, {group.rule()}; worst-case request "
            f"{worst.per_label[group.label]} pages"
        )
    return lines
