"""Host-tier copy bandwidth: pages moved between the device KV cache and the host tier by the
torch runner's `HostCache.apply`, at Llama-3-8B's page shape (32 layers, 8 KV heads, head dim
128, 16 tokens a page: 2 MiB a page in bfloat16 across layers).

Times batches of `--pages` page copies each way (device -> host as an eviction does, then
host -> device as a reload does), synchronising the device before and after, and prints the
median over `--repeats` runs in pages/s and GB/s. On CUDA the host tensors are pinned and the
copies asynchronous; on CPU both tiers are host memory, so the figure is a memcpy's.

    .venv/bin/python benchmarks/host_copy.py [--device cuda] [--pages 256] [--repeats 20]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvbank.engine.kv.host import Direction, HostMove
from kvbank.engine.model.attention import allocate_cache
from kvbank.engine.model.hostcache import HostCache

LAYERS, KV_HEADS, HEAD_DIM, PAGE_SIZE = 32, 8, 128, 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--pages", type=int, default=256, help="pages moved per batch")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--threads", type=int, default=1, help="torch threads (as serve's)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    device_pages = 2 * args.pages + 1
    caches = allocate_cache(LAYERS, device_pages, PAGE_SIZE, KV_HEADS, HEAD_DIM, dtype, device)
    host = HostCache(caches, args.pages)
    page_bytes = sum(c[0].numel() * c.element_size() for c in caches)
    out = [HostMove(Direction.TO_HOST, 1 + i, i) for i in range(args.pages)]
    back = [HostMove(Direction.TO_DEVICE, 1 + args.pages + i, i) for i in range(args.pages)]

    def timed(moves: list[HostMove]) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        host.apply(moves, caches)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    timed(out), timed(back)  # warm up
    print(
        f"device {device}, {args.dtype}, {page_bytes / 2**20:.2f} MiB a page "
        f"({LAYERS} layers), {args.pages} pages a batch, median of {args.repeats}"
    )
    for name, moves in (("device -> host", out), ("host -> device", back)):
        seconds = statistics.median(timed(moves) for _ in range(args.repeats))
        rate = args.pages / seconds
        print(
            f"{name}: {seconds * 1000:.2f} ms a batch, {rate:,.0f} pages/s, "
            f"{rate * page_bytes / 1e9:.2f} GB/s, {seconds * 1000 / args.pages:.4f} ms a page"
        )


if __name__ == "__main__":
    main()
