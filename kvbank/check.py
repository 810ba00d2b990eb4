"""`kvbank check FILE...`: the same holdability rules the operator's webhook runs.

Exit codes: 0 every pool is holdable, 1 some pool violates a rule, 2 a file cannot be read as
ModelPool manifests.
"""

from __future__ import annotations

import argparse
import sys

from kvbank.capacity import holdability
from kvbank.fields import quote
from kvbank.manifests import ManifestError, load_documents
from kvbank.modelpool import KIND, SpecError, parse_modelpool

__all__ = ["ManifestError", "load_documents", "run"]  # the sidecar's --pool reads the same way


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "files",
        nargs="+",
        metavar="FILE",
        help="YAML files with one or more ModelPool documents ('-' for stdin)",
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
            try:
                pool = parse_modelpool(doc)
            except SpecError as exc:
                print(f"error: {where}: not a valid {KIND}:", file=sys.stderr)
                for err in exc.errors:
                    print(f"  - {err}", file=sys.stderr)
                worst_exit = 2
                continue
            result = holdability(pool)
            name = f"{pool.namespace}/{pool.name}"
            if result.ok:
                print(
                    f"OK {where} {name}: worst-case request {result.worst_request_pages} "
                    f"pages; the pool ({result.pages} pages) holds {result.worst_concurrency} "
                    f"worst-case requests at once"
                )
            else:
                print(f"FAIL {where} {name}: {len(result.violations)} violation(s):")
                for violation in result.violations:
                    print(f"  - {violation}")
                worst_exit = max(worst_exit, 1)
    return worst_exit
