"""Writing a benchmark's results: `<out>/<name>.json` (meta and rows) and `<out>/<name>.md` (its table)."""

from __future__ import annotations

import json
import platform
from pathlib import Path


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else what `platform` says."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def write_report(out: str | Path, name: str, meta: dict, rows: list[dict], table: str) -> None:
    """Writes `name`.json and `name`.md under `out` (created if missing) and prints the table."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1) + "\n")
    (out / f"{name}.md").write_text(table)
    print("\n" + table)
