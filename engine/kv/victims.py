"""A preempted best-effort request's pages kept as cache (`cache_output`): its readmission
leases what is still cached, or reloads what went to host, instead of recomputing it.

Every full page it computed is indexed, its output's too, chained under its prompt (each page
under the request's own previous page, which it holds, so the chain rule of the prefix index
holds). The request then releases its pages as usual: they become cached, re-stamped as just
used, and eviction, which takes leaves only and the least recently used first, takes other idle
pages first and then the victim's tail, only as many pages as a shortage needs.
"""

from __future__ import annotations

from kvbank.engine.kv.cache import KVCache
from kvbank.engine.request import Request


def caches_output(req: Request) -> bool:
    """Whether `cache_output` keeps the request's computed pages: only for a request whose every
    label is keyed and writes one position per token (a decoder's KV), which is what keys a page
    by its tokens, and whose chain still matches the index."""
    return (
        req.index_open
        and req.cacheable
        and all(lay.per_prompt == 1 and lay.per_output == 1 for lay in req.layout)
    )


def cache_output(kv: KVCache, req: Request) -> None:
    """Before a preempted request lets its pages go: index every full page it computed, its
    output's too, and mark it so that its next peek matches its prompt and output."""
    if not caches_output(req):
        return
    tokens = req.prompt + req.output
    index = kv.index
    full = min(req.num_computed, len(tokens)) // kv.page_size
    while req.indexed < full:
        position = req.indexed
        key = index.page_key(tokens, position)
        for lay in req.layout:
            table = req.pages[lay.name]
            parent = table[position - 1] if position else None
            if not index.insert(lay.name, parent, key, table[position]):
                req.index_open = False  # another request indexed this prefix first
                break
        else:
            req.indexed += 1
            continue
        break
    req.output_cached = True
