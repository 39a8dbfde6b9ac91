"""Merge the JSON of benchmarks/kernels.py run in parts (gpu_suite.sh) into one OUT/kernels.json.

    python benchmarks/gpu_merge_kernels.py OUT    # reads OUT/kernels-part-*.json, writes OUT/kernels.json

Each part measured its own copy bandwidth; they are kept per part. The part files are removed (the
device tool brings back at most 8 files).
"""

import json
import sys
from pathlib import Path


def main(out: Path) -> int:
    files = sorted(out.glob("kernels-part-*.json"))
    parts = {path.stem.removeprefix("kernels-part-"): json.loads(path.read_text()) for path in files}
    merged = {
        "device": next((part["device"] for part in parts.values()), None),
        "copy_bandwidth": {name: part["copy_bandwidth"] for name, part in parts.items()},
        "rows": [row for part in parts.values() for row in part["rows"]],
    }
    (out / "kernels.json").write_text(json.dumps(merged))
    for path in files:
        path.unlink()
    print(f"kernels.json: {len(merged['rows'])} rows from parts {', '.join(parts) or 'none'}")
    return 0 if parts else 1


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
