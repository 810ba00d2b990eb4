"""`kvbank serve`'s service-class flags: the pool's default class and how best-effort requests
are admitted and preempted. They build `EngineConfig.classes` (kvbank/service_class.py) on
every rank."""

from __future__ import annotations

import argparse
from typing import Any

from kvbank.service_class import DEFAULT_MAX_PREEMPTIONS, Estimate, ServiceClass, Victim

CLASSES = tuple(c.value for c in ServiceClass)
VICTIMS = tuple(v.value for v in Victim)
ESTIMATES = tuple(e.value for e in Estimate)


def add_class_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--default-class",
        default=ServiceClass.STRICT.value,
        metavar="CLASS",
        help="the class of a request whose service_tier is auto, default or absent: strict "
        "(never preempted) or best-effort (may be preempted on a shortage); default: "
        "%(default)s",
    )
    parser.add_argument(
        "--max-preemptions",
        type=int,
        default=DEFAULT_MAX_PREEMPTIONS,
        metavar="N",
        help="times a best-effort request may be preempted; after that it is admitted as "
        "strict and runs to completion (default: %(default)s)",
    )
    parser.add_argument(
        "--victim",
        default=Victim.NEWEST.value,
        metavar="RULE",
        help="which best-effort request a shortage preempts: newest (the most recently "
        "arrived) or cheapest (the least to rebuild after host reload); default: %(default)s",
    )
    parser.add_argument(
        "--estimate",
        default=Estimate.LEARNED.value,
        metavar="HOW",
        help="how best-effort admission estimates a request's output: learned (the output "
        "lengths the pool has seen for its class) or ratio (a decaying share of its budget); "
        "default: %(default)s",
    )


def class_options(args: argparse.Namespace) -> dict[str, Any]:
    """The ServeOptions fields of the class flags. Raises ValueError naming the flag; argparse's
    own `choices` would print the values but not say what they mean."""
    if args.default_class not in CLASSES:
        raise ValueError(
            f"--default-class {str(args.default_class)[:40]!r} is not a service class; choose "
            f"{' or '.join(CLASSES)}"
        )
    if args.max_preemptions < 0:
        raise ValueError(
            f"--max-preemptions must be at least 0 (the times a best-effort request may be "
            f"preempted), got {args.max_preemptions}"
        )
    if args.victim not in VICTIMS:
        raise ValueError(
            f"--victim {str(args.victim)[:40]!r} is not a victim rule; choose "
            f"{' or '.join(VICTIMS)}"
        )
    if args.estimate not in ESTIMATES:
        raise ValueError(
            f"--estimate {str(args.estimate)[:40]!r} is not an output estimate; choose "
            f"{' or '.join(ESTIMATES)}"
        )
    return {
        "estimate": args.estimate,
        "default_class": args.default_class,
        "max_preemptions": args.max_preemptions,
        "victim": args.victim,
    }
