"""Markdown tables of `python -m bench.dcp`'s figures (every ratio is against fsw, in the same run)."""

from __future__ import annotations

import statistics
from typing import Any

MB = 1e6


def _ratio(value: float, base: float) -> str:
    return f"{value / base:.2f}x" if base else "-"


def _run_table(result: dict[str, Any], run: str) -> list[str]:
    figures = result["runs"][run]
    saves = figures["save_seconds"]
    stored = figures["stored"]
    loads = {4: figures["load"]["seconds"]}
    loads.update({int(w): r["load"][run]["seconds"] for w, r in result["reshard"].items()})
    worlds = sorted(loads, reverse=True)
    lines = [f"**{run}** ({len(saves['fsw'])} checkpoints; ckptstore loads bit-exact: "
             f"{figures['load']['exact'] and all(r['load'][run]['exact'] for r in result['reshard'].values())})", "",
             "| method | stored MB | fsw / method | save s (median) | vs fsw | "
             + " | ".join(f"load s at {w} | vs fsw" for w in worlds) + " |",
             "|---|---|---|---|---|" + "---|---|" * len(worlds)]
    base_save = statistics.median(saves["fsw"])
    for method in saves:
        save = statistics.median(saves[method])
        cells = [method, f"{stored.get(method, 0) / MB:.0f}", _ratio(stored["fsw"], stored.get(method, 0)),
                 f"{save:.2f}", _ratio(save, base_save)]
        for w in worlds:
            load = loads[w].get(method)
            cells += [f"{load:.2f}", _ratio(load, loads[w]["fsw"])] if load is not None else ["-", "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _async_table(result: dict[str, Any]) -> list[str]:
    lines = ["| run | method | async_save blocking s (each) | vs fsw | until done s (each) |", "|---|---|---|---|---|"]
    for run in ("finetune", "scratch"):
        pairs = result["runs"][run]["async"]
        if not pairs["fsw"]:  # fewer checkpoints than the first of ASYNC_AT: nothing measured
            continue
        base = statistics.median(b for b, _ in pairs["fsw"])
        for method, rows in pairs.items():
            blocked = statistics.median(b for b, _ in rows)
            lines.append(f"| {run} | {method} | {', '.join(f'{b:.2f}' for b, _ in rows)} | {_ratio(blocked, base)} | "
                         f"{', '.join(f'{d:.2f}' for _, d in rows)} |")
    return lines


def _scaling_table(result: dict[str, Any]) -> list[str]:
    rows = {4: result["runs"]["scaling"]}
    rows.update({int(w): r["scaling"] for w, r in result["reshard"].items()})
    lines = ["| ranks | first commit s | second commit s | of which coordinator's finish s | first: MB per rank "
             "| second: MB per rank | second: total MB |", "|---|---|---|---|---|---|---|"]
    for world in sorted(rows):
        first, second = rows[world]
        lines.append(f"| {world} | {first['seconds']:.2f} | {second['seconds']:.2f} | "
                     f"{first.get('finish_seconds', 0):.2f}, {second.get('finish_seconds', 0):.2f} | "
                     f"{', '.join(f'{b / MB:.0f}' for b in first['bytes_per_rank'])} | "
                     f"{', '.join(f'{b / MB:.1f}' for b in second['bytes_per_rank'])} | "
                     f"{sum(second['bytes_per_rank']) / MB:.1f} |")
    return lines


def _shape_table(result: dict[str, Any]) -> list[str]:
    lines = ["| ranks | entries | new records | new chunk rows | new objects | manifest KB |",
             "|---|---|---|---|---|---|"]
    for world, shape in sorted(result.get("shape", {}).items(), key=lambda kv: int(kv[0])):
        lines.append(f"| {world} | {shape['entries']} | {shape['new_records']} | {shape['new_chunk_rows']} | "
                     f"{shape['new_objects']} | {shape['manifest_bytes'] / 1e3:.0f} |")
    return lines


def tables(result: dict[str, Any]) -> str:
    """Every table of one `bench.dcp` run, as markdown."""
    out = []
    for run in ("finetune", "scratch"):
        out += _run_table(result, run) + [""]
    out += _async_table(result) + [""] + _scaling_table(result) + [""] + _shape_table(result)
    out.append(f"\n(whole run: {result['seconds']:.0f} s; {result['args']})")
    return "\n".join(out)
