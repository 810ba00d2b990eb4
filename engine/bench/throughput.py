"""CPU serving throughput of the built-in model through the real HTTP server.

    python -m kvbank.engine.bench.throughput --concurrency 1,8 --runs 5

Starts `kvbank serve`'s server in-process on loopback (built-in model, embedded banker ledger,
torch attention), then for each concurrency sends that many streaming-free completions at once,
each generating exactly --max-tokens tokens (end-of-text is disabled so every run does the same
work), and reports the median over runs of generated tokens per second of wall time.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from kvbank.engine.serve.command import build_server
from kvbank.engine.serve.stack import ServeOptions, build_stack


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args(argv)

    stack = build_stack(ServeOptions(pages=1024, max_tokens=args.max_tokens, threads=args.threads))
    stack.runner.eos_token_id = -1  # fixed work per request
    port = _free_port()
    server, loop = build_server(stack, "127.0.0.1", port)
    loop.start()
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    url = f"http://127.0.0.1:{port}/v1/completions"
    vocab = stack.config.vocab_size
    print(f"built-in model ({stack.config.num_layers} layers, hidden {stack.config.hidden_size}),"
          f" {args.prompt_tokens}-token prompts, {args.max_tokens} tokens each, "
          f"{args.threads} torch thread(s), median of {args.runs} runs")  # fmt: skip
    try:
        with httpx.Client(timeout=600) as client:
            for concurrency in [int(c) for c in args.concurrency.split(",")]:
                rates = []
                for run in range(args.runs + 1):  # the first run warms up
                    prompts = [
                        [
                            (7 + 31 * (run * 100 + i) + 13 * j) % vocab
                            for j in range(args.prompt_tokens)
                        ]
                        for i in range(concurrency)
                    ]

                    def ask(prompt: list[int]) -> int:
                        body = {"prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0}
                        reply = client.post(url, json=body).json()
                        return int(reply["usage"]["completion_tokens"])

                    started = time.perf_counter()
                    with ThreadPoolExecutor(concurrency) as pool:
                        generated = sum(pool.map(ask, prompts))
                    elapsed = time.perf_counter() - started
                    if run:
                        rates.append(generated / elapsed)
                print(f"concurrency {concurrency}: {statistics.median(rates):.0f} tokens/s "
                      f"(runs: {', '.join(f'{r:.0f}' for r in rates)})")  # fmt: skip
    finally:
        server.should_exit = True
        thread.join(10)
        loop.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
