"""`python -m adapters ADAPTER BASE_CONFIG [--max-rank N] [--save DIR]`: validate an adapter the way an upload is.

Prints the adapter's digest, ranks and scalings as JSON, or the refusal (exit status 2).
"""

import argparse
import json
import sys
from pathlib import Path

from adapters.errors import AdapterError
from adapters.loader import DEFAULT_MAX_RANK, load_adapter


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m adapters", description=__doc__.splitlines()[0])
    parser.add_argument("adapter", type=Path, help="PEFT adapter folder, .zip, .tar or .tar.gz")
    parser.add_argument("base_config", type=Path, help="the base model's config.json (or its folder)")
    parser.add_argument("--max-rank", type=int, default=DEFAULT_MAX_RANK)
    parser.add_argument("--save", type=Path, help="write the canonical form to this folder")
    args = parser.parse_args(argv)
    config_path = args.base_config / "config.json" if args.base_config.is_dir() else args.base_config
    base_config = json.loads(config_path.read_text())
    try:
        adapter = load_adapter(args.adapter, base_config, max_rank=args.max_rank)
    except AdapterError as refused:
        print(json.dumps({"ok": False, "code": refused.code, "message": refused.message}, indent=2))
        return 2
    if args.save:
        adapter.save(args.save)
    summary = {
        "ok": True,
        "digest": adapter.digest,
        "rank": adapter.rank,
        "alpha": adapter.alpha,
        "target_modules": adapter.target_modules,
        "num_bytes": adapter.num_bytes,
        "ranks": adapter.ranks,
        "scaling": adapter.scaling,
    }
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
