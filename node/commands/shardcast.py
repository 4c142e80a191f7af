"""`publish` and `fetch`: put a checkpoint into a Shardcast store; download one from sources."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from node.cli import CliError, command, load_key, load_spec
from node.paths import default_data_dir
from node.timeouts import DOWNLOAD_DEADLINE_S

if TYPE_CHECKING:
    from node.shardcast.download import DownloadConfig
    from protocol.runspec import SignedRunSpec


def _step_arg(text: str) -> int | None:
    if text == "latest":
        return None
    if not text.isdigit():
        raise argparse.ArgumentTypeError("must be a non-negative integer or 'latest'")
    return int(text)


def _meta_arg(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError("must be KEY=VALUE")
    return key, value


@command
def _publish(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("publish", help="cut a checkpoint into pieces and sign its manifest into a Shardcast store")
    p.add_argument("path", help="a safetensors file, or a directory whose top-level files form the checkpoint")
    p.add_argument("--step", type=int, required=True, help="policy step of the checkpoint")
    p.add_argument("--run", required=True, help="the signed run spec (TOML)")
    p.add_argument("--key", required=True, help="the coordinator's key file")
    p.add_argument("--data-dir", default=None, help=f"node data directory holding the store (default: {default_data_dir()})")
    p.add_argument("--meta", type=_meta_arg, action="append", default=[], metavar="KEY=VALUE", help="manifest annotation (repeatable)")
    p.add_argument("--delta-from", type=int, default=None, metavar="STEP",
                   help="also publish the step delta from this complete, earlier step of the store (docs/shardcast.md §9)")
    p.set_defaults(handler=_run_publish)


def _run_publish(args: argparse.Namespace) -> int:
    from node.errors import ShardcastError
    from node.shardcast.publish import checkpoint_files, publish_checkpoint
    from node.shardcast.store import ShardcastStore
    from protocol.shardcast import iter_pieces, total_size_bytes

    signed = load_spec(args.run)
    key = load_key(args.key)
    data_dir = Path(args.data_dir) if args.data_dir else default_data_dir()
    spec = signed.spec
    try:
        store = ShardcastStore(data_dir, run_id=signed.run_id, authorities=spec.authorities, keep_steps=spec.shardcast.keep_steps)
        env = publish_checkpoint(
            store, checkpoint_files(Path(args.path)), step=args.step, key=key,
            piece_size_bytes=spec.shardcast.piece_size_bytes, meta=dict(args.meta), delta_from=args.delta_from,
        )
    except ShardcastError as e:
        raise CliError(str(e)) from None
    m = env.body
    delta = store.delta(m.step) if args.delta_from is not None else None
    if delta is not None:
        print(f"delta {delta.body.base_step} → {m.step}: {delta.body.size_bytes} bytes, {len(delta.body.pieces)} pieces")
    elif args.delta_from is not None:
        print(f"no delta from step {args.delta_from} (see the log)", file=sys.stderr)
    print(
        f"published step {m.step}: {len(m.files)} file(s), {total_size_bytes(m)} bytes, "
        f"{sum(1 for _ in iter_pieces(m))} pieces of {m.piece_size_bytes} bytes; manifest {env.id.hex()}; store {store.root}"
    )
    return 0


@command
def _fetch(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("fetch", help="download a checkpoint from Shardcast sources, verifying every piece")
    p.add_argument("--run", required=True, help="the signed run spec (TOML)")
    p.add_argument("--step", type=_step_arg, default=None, metavar="N|latest", help="policy step (default: latest)")
    p.add_argument("--source", action="append", default=[], metavar="URL", help="origin or relay base URL (repeatable; default: the run spec's origin_urls)")
    p.add_argument("--out", required=True, help="directory to create with the checkpoint files")
    p.add_argument("--concurrency", type=int, default=8, help="pieces downloaded at once (default 8)")
    p.add_argument("--timeout", type=float, default=DOWNLOAD_DEADLINE_S, help=f"give up after this many seconds (default {DOWNLOAD_DEADLINE_S:.0f})")
    p.add_argument("--held", default=None, metavar="DIR",
                   help="a directory holding an earlier step (from an earlier fetch): reach --step by signed deltas from it "
                        "when the sources have them, else fetch in full (docs/shardcast.md §9)")
    p.set_defaults(handler=_run_fetch)


def _run_fetch(args: argparse.Namespace) -> int:
    import asyncio

    from node.errors import FetchError
    from node.shardcast.client import fetch_checkpoint
    from node.shardcast.download import DownloadConfig

    signed = load_spec(args.run)
    sources = args.source or list(signed.spec.network.origin_urls)
    if not sources:
        raise CliError("no sources: pass --source URL (or set network.origin_urls in the run spec)")
    if args.concurrency < 1 or args.timeout <= 0:
        raise CliError("--concurrency must be ≥ 1 and --timeout > 0")
    cfg = DownloadConfig(max_concurrency=args.concurrency, deadline_s=args.timeout)
    if args.held is not None:
        return _fetch_held(args, signed, sources, cfg)
    try:
        res = asyncio.run(
            fetch_checkpoint(sources, Path(args.out), run_id=signed.run_id, authorities=signed.spec.authorities, step=args.step, config=cfg,
                             origins=[u for u in sources if u in signed.spec.network.origin_urls])
        )
    except FetchError as e:
        print(f"error: fetch failed: {e}", file=sys.stderr)
        _print_faulty(e.faulty_sources)
        return 1
    _print_faulty(res.faulty_sources)
    mib = res.bytes_downloaded / 2**20
    print(
        f"fetched step {res.step} into {res.out_dir}: {mib:.1f} MiB downloaded in {res.elapsed_s:.2f} s"
        f" ({mib / max(res.elapsed_s, 1e-9):.0f} MiB/s), {res.pieces_resumed} pieces resumed"
    )
    return 0


def _print_faulty(faulty_sources: dict[str, str]) -> None:
    """Name each source a fetch found faulty, with its reason (stderr)."""
    for url, reason in faulty_sources.items():
        print(f"faulty source: {url} ({reason})", file=sys.stderr)


def _fetch_held(args: argparse.Namespace, signed: SignedRunSpec, sources: list[str], cfg: DownloadConfig) -> int:
    """``fetch --held DIR``: deltas from the held step when possible, else the full checkpoint."""
    import asyncio

    from node.errors import FetchError
    from node.shardcast.delta import fetch_step

    try:
        res = asyncio.run(fetch_step(sources, Path(args.out), run_id=signed.run_id, authorities=signed.spec.authorities,
                                     held_dir=Path(args.held), step=args.step, max_chain=signed.spec.shardcast.max_delta_chain,
                                     config=cfg))
    except FetchError as e:
        print(f"error: fetch failed: {e}", file=sys.stderr)
        _print_faulty(e.faulty_sources)
        return 1
    _print_faulty(res.faulty_sources)
    how = f"by {len(res.deltas_applied)} delta(s)" if res.via == "delta" else f"in full ({res.fallback_reason})"
    print(f"fetched step {res.step} into {res.out_dir} {how}: {res.bytes_downloaded / 2**20:.1f} MiB downloaded in {res.elapsed_s:.2f} s")
    return 0
