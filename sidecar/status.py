"""`kvbank status ADDR`: a sidecar's pool figures, queue and reservations.

Exit codes: 0 printed, 1 the sidecar did not answer or refused the call.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from kvbank.proto import admission_pb2 as pb
from kvbank.sidecar.client import SidecarClient, SidecarError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("address", metavar="ADDR", help="sidecar HOST:PORT")
    parser.add_argument("--token-file", help="file holding the sidecar's shared token")
    parser.add_argument(
        "--ca-file",
        metavar="PATH",
        help="PEM CA bundle that signed the sidecar's certificate: the channel is TLS",
    )
    parser.add_argument(
        "--tls-server-name",
        metavar="NAME",
        help="the name the sidecar's certificate must carry (default: ADDR's host)",
    )
    parser.add_argument(
        "--json", action="store_true", help="print the whole status as JSON, counts as numbers"
    )
    parser.add_argument("--limit", type=int, default=20, help="queue/reservation rows shown")
    parser.add_argument(
        "--deadline-s",
        type=float,
        default=2.0,
        help="seconds to wait for the sidecar's answer (no retries)",
    )


def as_json(message: Message) -> dict[str, object]:
    """Every field (defaults too) under its JSON name, 64-bit counts as numbers: protobuf's own
    JSON mapping writes int64 as strings, which no reader of a page count expects."""
    out: dict[str, object] = {}
    for field in message.DESCRIPTOR.fields:
        value = getattr(message, field.name)
        nested = field.type == FieldDescriptor.TYPE_MESSAGE
        if field.is_repeated:
            out[field.json_name] = [as_json(v) if nested else v for v in value]
        else:
            out[field.json_name] = as_json(value) if nested else value
    return out


def render(status: pb.StatusReply, limit: int) -> str:
    p = status.pool
    supply = p.free + p.evictable
    lines = [
        f"session   {status.session or 'none'}",
        f"pool      {p.total_pages} pages ({p.usable_pages} usable): free {p.free}, "
        f"evictable {p.evictable}, supply {supply}",
        f"promised  reserved {p.reserved}, held {p.held}, outstanding {p.outstanding} "
        f"(slack {supply - p.outstanding})",
        f"decisions next seq {status.next_seq}; log holds {status.log_length} from "
        f"{status.log_first_seq}",
        f"queue     {len(status.waiting)} waiting",
    ]
    lines += [f"  {_shown(w.rid):<24} {w.pages:>8} pages" for w in status.waiting[:limit]]
    if len(status.waiting) > limit:
        lines.append(f"  ... {len(status.waiting) - limit} more")
    lines.append(f"running   {len(status.running)} admitted")
    lines += [
        f"  {_shown(r.rid):<24} seq {r.seq:>6}  reserved {r.reserved:>6}  held {r.held:>6}"
        for r in status.running[:limit]
    ]
    if len(status.running) > limit:
        lines.append(f"  ... {len(status.running) - limit} more")
    lines.append(f"followers {len(status.followers)}")
    lines += [f"  {_shown(f.follower_id):<24} acked {f.acked_seq}" for f in status.followers]
    return "\n".join(lines)


def _shown(name: str) -> str:
    """An id as the terminal should show it: the engine sent it, so control characters (an
    escape sequence, a newline faking a row) are written escaped."""
    return name if name.isprintable() else ascii(name)


def run(args: argparse.Namespace) -> int:
    try:
        token = Path(args.token_file).read_text().strip() if args.token_file else None
        ca = Path(args.ca_file).read_bytes() if args.ca_file else None
    except OSError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    client = SidecarClient(
        args.address,
        token=token,
        tls_ca=ca,
        tls_server_name=args.tls_server_name,
        deadline_s=args.deadline_s,
        retry_budget_s=0,
    )
    try:
        status = client.status_reply()
    except SidecarError as exc:
        hint = ""
        if exc.code == "UNAVAILABLE":
            hint = (
                "; if it serves TLS, is its certificate signed by --ca-file's CA, for that "
                "name (--tls-server-name)?"
                if ca
                else "; if it serves TLS, give --ca-file"
            )
        print(f"error: sidecar {args.address}: {exc}{hint}", file=sys.stderr)
        return 1
    finally:
        client.close()
    if args.json:
        print(json.dumps(as_json(status)))
    else:
        print(render(status, args.limit))
    return 0
