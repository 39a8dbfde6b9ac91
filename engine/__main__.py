"""`python -m engine --model DIR ...`: the engine process. Flags and environment are read here only.

Environment: QUILT_ENGINE_TOKEN (required: the bearer token every call must carry),
CELERY_BROKER_URL (where usage events go; flag --broker-url wins; unset: events only spool to disk),
QUILT_CONTROL_PLANE_URL (flag --control-plane wins: join that control plane's fleet and heartbeat to it; unset: a
static engine, listed with `manage.py registerengine`), QUILT_ENGINE_NAME, QUILT_ADVERTISE_URL, QUILT_ENGINE_POOL,
QUILT_GPU_PRICE_PER_HOUR (the flags of the same names win).
"""

import argparse
import dataclasses
import gc
import logging
import os
import re
import socket
import sys
import types
import typing
import urllib.parse
from pathlib import Path

from engine.config import EngineConfig
from engine.contract import KEEP_ALIVE_SECONDS
from engine.contract.channel import CHANNEL_MAX_BYTES

ENGINE_FLAGS_SKIPPED = {"model", "device", "kv_landing_bytes"}  # the last from --kv-transfer-landing-mb
ENGINE_FLAGS_HELP = {"block_size": "tokens per KV page (default: 16, or the smallest power of two above it whose "
                                   "page holds the model's adapter rows)",
                    "cuda_graphs": "on CUDA, decode steps replay CUDA graphs per padded batch size (default: on; "
                                   "docs/gpu.md)",
                    "role": "prefill, decode or both (default): what the gateway sends this engine, said in its "
                            "registration and /v1/state (docs/kv-tiers.md)",
                    "num_kv_blocks": "pages of the one KV + adapter pool sized for KV (default: from memory); "
                                     "the pool is this plus --pool-adapter-bytes (docs/engine-memory.md)",
                    "pool_adapter_bytes": "bytes of pages added to the one pool for adapters (default: the bytes "
                                          "of --pool-adapters-at-max-rank adapters); KV may use them too",
                    "pool_adapters_at_max_rank": "sizes the default --pool-adapter-bytes: this many adapters of "
                                                 "--max-adapter-rank on every projection (default: 8); not a cap",
                    "max_adapter_slots": "deprecated: --pool-adapters-at-max-rank (mapped, with a warning)",
                    "adapter_memory_bytes": "deprecated: --pool-adapter-bytes (mapped, with a warning)"}


def engine_config_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field (`max_num_seqs` -> `--max-num-seqs`), defaults from the dataclass."""
    group = parser.add_argument_group("engine configuration")
    for field in dataclasses.fields(EngineConfig):
        if field.name in ENGINE_FLAGS_SKIPPED:
            continue
        flag = "--" + field.name.replace("_", "-")
        kind = field.type
        if typing.get_origin(kind) in (typing.Union, types.UnionType):
            kind = next(arm for arm in typing.get_args(kind) if arm is not type(None))
        if kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=field.default,
                               help=ENGINE_FLAGS_HELP.get(field.name))
        else:
            group.add_argument(flag, type=kind, default=field.default,
                               help=ENGINE_FLAGS_HELP.get(field.name, f"default: {field.default}"))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m engine", description="Quilt's inference engine server.")
    parser.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--adapter-store", type=Path, help="where adapters are stored, one folder per digest")
    fetch = parser.add_argument_group("adapters from remote storage (docs/residency.md)")
    fetch.add_argument("--adapter-disk-cache", type=Path,
                       help="folder for adapters downloaded through the signed URLs a request hands (remote "
                            "storage); unset: a request with adapter.urls is refused")
    fetch.add_argument("--adapter-disk-cache-bytes", type=int, default=20 * 1024**3,
                       help="most bytes of downloaded adapters kept in --adapter-disk-cache, downloads in flight "
                            "included; least recently used first out (default: 20 GiB)")
    fetch.add_argument("--adapter-download-timeout", type=float, default=120.0,
                       help="seconds one adapter's download may take before its requests fail (adapter_unavailable)")
    parser.add_argument("--served-model-name", help="base model name in usage events (default: the folder name)")
    parser.add_argument("--broker-url", default=os.environ.get("CELERY_BROKER_URL"),
                        help="Celery broker for usage events (default: $CELERY_BROKER_URL; empty: spool only)")
    parser.add_argument("--usage-queue", default=None, help="broker queue for usage events (default: Celery's)")
    parser.add_argument("--usage-spool", type=Path, help="spool file (default: var/usage-spool/engine-PORT.jsonl)")
    parser.add_argument("--drain-timeout", type=float, default=30.0,
                        help="seconds running requests may finish in on shutdown before they are aborted")
    parser.add_argument("--timeout-keep-alive", type=float, default=KEEP_ALIVE_SECONDS,
                        help="seconds an idle connection stays open (default: %(default)s; uvicorn's 5 s raced the "
                             "gateway's reuse of its connections)")
    parser.add_argument("--log-level", default="info")
    fleet = parser.add_argument_group("fleet membership (docs/fleet.md)")
    fleet.add_argument("--control-plane", default=os.environ.get("QUILT_CONTROL_PLANE_URL"),
                       help="control plane (gateway) base URL to register and heartbeat with; unset: a static engine")
    fleet.add_argument("--engine-name", default=os.environ.get("QUILT_ENGINE_NAME"),
                       help="the engine's name in the fleet (default: HOSTNAME-PORT)")
    fleet.add_argument("--advertise-url", default=os.environ.get("QUILT_ADVERTISE_URL"),
                       help="where gateways reach this engine (default: http://HOST:PORT, HOST this machine's address "
                            "when listening on all interfaces: a container's or a pod's own IP)")
    fleet.add_argument("--pool", default=os.environ.get("QUILT_ENGINE_POOL", "default"))
    fleet.add_argument("--gpu-price-per-hour", default=os.environ.get("QUILT_GPU_PRICE_PER_HOUR", "0"),
                       help="this engine's $/h, for cost per token (a decimal)")
    fleet.add_argument("--heartbeat-interval", type=float, default=2.0,
                       help="seconds between heartbeats; 3 missed ones take the engine out of routing")
    fleet.add_argument("--leave-grace", type=float, default=2.0,
                       help="on SIGTERM, seconds the engine keeps serving after leaving routing, before it drains")
    kv = parser.add_argument_group("KV transfer between engines (docs/kv-tiers.md)")
    kv.add_argument("--kv-transfer-port", type=int, default=0,
                    help="TCP port other engines pull leased KV blocks from (default: any free port, advertised in "
                         "each lease)")
    kv.add_argument("--kv-transfer-shm", action=argparse.BooleanOptionalAction, default=True,
                    help="offer the blocks through shared memory (/dev/shm) to engines on this host")
    kv.add_argument("--kv-transfer-timeout", type=float, default=10.0,
                    help="seconds a decode hop waits for each step of a pull before it recomputes instead")
    kv.add_argument("--kv-transfer-backend", choices=("nixl", "shm", "tcp"),
                    default=os.environ.get("QUILT_KV_TRANSFER_BACKEND", "nixl"),
                    help="how KV blocks move: nixl (NIXL over UCX: RDMA, NVLink, CUDA IPC or TCP; where the package "
                         "imports, else shm), shm (shared memory with engines on this host, else TCP) or tcp; "
                         "the log says which is used")
    kv.add_argument("--kv-transfer-landing-mb", type=float, default=256.0,
                    help="MiB this engine registers with NIXL for blocks pushed to it (at most a quarter of its pool)")
    kv.add_argument("--kv-transfer-fault", choices=("fail-halfway", "stall", "corrupt"), default=None,
                    help="for tests: every pull this engine serves goes wrong so (engine/kv/faults.py)")
    engine_config_flags(parser)
    return parser.parse_args(argv)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig the flags say; ValueError when they are invalid. The NIXL landing area is kept out of the
    pool's share of device memory only where NIXL may be used."""
    fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)
              if f.name not in ENGINE_FLAGS_SKIPPED}
    landing = int(args.kv_transfer_landing_mb * (1 << 20)) if args.kv_transfer_backend == "nixl" else 0
    return EngineConfig(model=str(args.model), device=args.device, kv_landing_bytes=landing, **fields)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    token = os.environ.get("QUILT_ENGINE_TOKEN", "")
    if not token:
        print("QUILT_ENGINE_TOKEN is not set: the engine refuses to serve without a bearer token", file=sys.stderr)
        return 2
    if args.kv_transfer_landing_mb <= 0:
        print("--kv-transfer-landing-mb must be > 0", file=sys.stderr)
        return 2
    if args.kv_transfer_timeout <= 0:
        print("--kv-transfer-timeout must be > 0", file=sys.stderr)
        return 2
    if args.adapter_disk_cache_bytes <= 0 or args.adapter_download_timeout <= 0:
        print("--adapter-disk-cache-bytes and --adapter-download-timeout must be > 0", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    import uvicorn

    from adapters.loaded import SIDECAR_NAME
    from engine.kv.faults import Fault
    from engine.llm_engine import LLMEngine
    from engine.server.adapter_disk_cache import AdapterDiskCache
    from engine.server.adapter_fetch import AdapterFetcher
    from engine.server.adapter_registry import AdapterRegistry
    from engine.server.app import EngineAPI, build_app
    from engine.server.engine_loop import EngineLoop
    from engine.server.kv_transfer import KVTransfers
    from engine.server.membership import Draining, Identity, Membership
    from engine.server.metrics import EngineMetrics
    from engine.usage.emitter import UsageEmitter

    try:
        config = engine_config(args)
        engine = LLMEngine(config)  # checks what needs the model: its length, head counts, block size
    except ValueError as error:
        print(f"invalid engine configuration: {error}", file=sys.stderr)
        return 2
    engine_name = args.engine_name or re.sub(r"[^A-Za-z0-9_-]+", "-", f"{socket.gethostname()}-{args.port}")[-64:]
    host = socket.gethostbyname(socket.gethostname()) if args.host in ("0.0.0.0", "::") else args.host
    # One spool file per engine: scaled containers may share the spool volume.
    spool = args.usage_spool or Path("var/usage-spool") / (f"engine-{engine_name}.jsonl" if args.control_plane
                                                           else f"engine-{args.port}.jsonl")
    emitter = UsageEmitter(broker_url=args.broker_url or None, spool_path=spool, queue_name=args.usage_queue).start()
    loop = EngineLoop(engine, metrics=EngineMetrics(), emitter=emitter,
                      base_model=args.served_model_name or Path(args.model).resolve().name)
    fetcher = None
    if args.adapter_disk_cache is not None:
        cache = AdapterDiskCache(args.adapter_disk_cache, max_bytes=args.adapter_disk_cache_bytes,
                                 complete_marker=SIDECAR_NAME)
        fetcher = AdapterFetcher(cache, timeout_s=args.adapter_download_timeout)
    registry = AdapterRegistry(loop, store=args.adapter_store, fetcher=fetcher)
    advertise = urllib.parse.urlsplit(args.advertise_url).hostname if args.advertise_url else None
    kv = KVTransfers(loop, engine_id=engine_name, host=args.host, advertise_host=advertise or host,
                     port=args.kv_transfer_port, shm=args.kv_transfer_shm, timeout_s=args.kv_transfer_timeout,
                     backend=args.kv_transfer_backend, landing_mb=args.kv_transfer_landing_mb,
                     fault=Fault(args.kv_transfer_fault) if args.kv_transfer_fault else None)
    api = EngineAPI(loop, registry=registry, model_name=loop.base_model, drain_timeout_s=args.drain_timeout, kv=kv)
    if args.control_plane:
        identity = Identity(
            control_plane=args.control_plane.rstrip("/"), name=engine_name,
            url=(args.advertise_url or f"http://{host}:{args.port}").rstrip("/"), pool=args.pool,
            gpu_price_per_hour=str(args.gpu_price_per_hour), token=token, interval_s=args.heartbeat_interval,
        )  # fmt: skip
        api.membership = Membership(identity, loop, api.prefixes)
    app = build_app(api, token=token)
    logging.getLogger(__name__).info("engine ready on http://%s:%d (model %s, device %s)",
                                     args.host, args.port, args.model, args.device)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.drain_timeout, timeout_keep_alive=args.timeout_keep_alive,
                            access_log=False, http="httptools", loop="uvloop", ws="websockets-sansio",
                            ws_max_size=CHANNEL_MAX_BYTES)
    gc.freeze()  # the model, its modules and its imports live as long as the process: no full collection walks them
    Draining(config, loop=loop, membership=api.membership, grace_s=args.leave_grace, channel=api.channel).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
