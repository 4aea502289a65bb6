"""Writing a benchmark's results: `<out>/<name>.json` (meta and rows) and `<out>/<name>.md` (its table)."""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Callable
from datetime import date
from pathlib import Path


def cpu_name() -> str:
    """The CPU's model name with its family and model numbers (/proc/cpuinfo: "AMD EPYC (family 26, model 2)",
    which tells Zen 4 (25) from Zen 5 (26) where the name does not), else what `platform` says."""
    try:
        with open("/proc/cpuinfo") as f:
            fields = dict(line.split(":", 1) for line in f.read().split("\n\n")[0].splitlines() if ":" in line)
    except OSError:
        fields = {}
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    if "model name" not in fields:
        return platform.processor() or platform.machine()
    if "cpu family" not in fields or "model" not in fields:
        return fields["model name"]
    return f"{fields['model name']} (family {fields['cpu family']}, model {fields['model']})"


def write_report(out: str | Path, name: str, meta: dict, rows: list[dict], table: str) -> None:
    """Writes `name`.json and `name`.md under `out` (created if missing) and prints the table."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1) + "\n")
    (out / f"{name}.md").write_text(table)
    print("\n" + table)


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def run_models(args, prefix: str, fields: dict, markdown: Callable, run_model: Callable) -> None:
    """Runs `run_model(model, args)` for each of `args.models`, the report `<prefix>_<device>_<date>`
    (`args.name` if set) rewritten under `args.out` at every `args.on_row(rows)` the runs call, so that
    partial results survive an interrupted run. Its meta: date, device, CPU, cores, jax, load average at
    start and at the last write, then `fields`."""
    import jax

    device = jax.devices()[0].device_kind
    name = getattr(args, "name", None) or f"{prefix}_{device.replace(' ', '_')}_{date.today()}"
    meta = dict(
        date=str(date.today()),
        device=device,
        cpu=cpu_name(),
        cores=len(os.sched_getaffinity(0)),
        jax=jax.__version__,
        load_average=load_average(),
        **fields,
    )
    done: list[dict] = []

    def on_row(rows):
        meta["load_average_end"] = load_average()
        write_report(args.out, name, meta, done + rows, markdown(meta, done + rows))

    args.on_row = on_row
    for model in args.models:
        done += run_model(model, args)
        jax.clear_caches()  # each model's compiled programs hold XLA:CPU memory maps (vm.max_map_count)
