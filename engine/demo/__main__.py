"""`python -m engine.demo [--out DIR] [--force]`: build the demo model and adapters (cached), then show them."""

import argparse
import json
import shutil
import sys
from pathlib import Path

from engine.demo.builder import DEFAULT_OUT, STAMP, ensure_demo


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.demo", description=__doc__)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"default: {DEFAULT_OUT}")
    parser.add_argument("--force", action="store_true", help="rebuild even if a build of this version is there")
    args = parser.parse_args(argv)
    if args.force:
        shutil.rmtree(args.out, ignore_errors=True)
    out = ensure_demo(args.out)
    stamp = json.loads((out / STAMP).read_text())
    print(f"demo model: {out}")
    for skill, info in stamp["adapters"].items():
        print(f"  adapter {skill:8s} {out / info['path']}  (rank {info['rank']})")
    print(f"  held-out accuracy: {stamp['held_out_accuracy']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
