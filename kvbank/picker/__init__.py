"""The endpoint picker: routes a request to a pod whose ledger would admit it now.

`rule` is the routing rule itself, pure (`pick` over each pod's `PodFigures`), shared by the
picker service and the cluster bench (`kvbank bench --replicas N --router kvbank`).
"""

from kvbank.picker.rule import (
    Answer,
    NoEndpoint,
    Pick,
    PodFigures,
    Refuse,
    Release,
    RequestCount,
    Shed,
    count_request,
    pick,
)

__all__ = [
    "Answer",
    "NoEndpoint",
    "Pick",
    "PodFigures",
    "Refuse",
    "Release",
    "RequestCount",
    "Shed",
    "count_request",
    "pick",
]
