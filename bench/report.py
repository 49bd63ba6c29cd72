"""Tables (Markdown) and plots (PNG) from benchmark results."""

from __future__ import annotations

import statistics
from pathlib import Path

BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"
ZIPNN = "ZipNN per tensor"


def _mb(n: float) -> float:
    return n / 1e6


def method_rows(result: dict) -> list[dict]:
    """One summary row per method for a run."""
    sizes = result["sizes"]
    raw = sum(sizes)
    zipnn = result["methods"][ZIPNN]
    rows = []
    for name, m in result["methods"].items():
        stored = sum(m["stored"]) + m.get("metadata_bytes", 0)  # results from before 6 December 2026 lack it
        row = {
            "method": name,
            "stored_mb": _mb(stored),
            "ratio": raw / stored,
            "vs_zipnn_size": (sum(zipnn["stored"]) + zipnn.get("metadata_bytes", 0)) / stored,
            "commit_mbs": statistics.median(_mb(s) / t for s, t in zip(sizes, m["commit_s"])),
            "vs_zipnn_speed": statistics.median(z / t for t, z in zip(m["commit_s"], zipnn["commit_s"])),
            "checkout_mbs": statistics.median(_mb(s) / t for s, t in zip(sizes, m["checkout_s"])),
            "commit_mem_mb": _mb(max(m["commit_mem"])),
            "checkout_mem_mb": _mb(max(m["checkout_mem"])),
        }
        if m["lossy"]:
            changes = [(e - o) / o * 100 for e, o in zip(m["eval"], result["original_eval"])]
            row["eval_change_max"] = max(changes, key=abs)
            row["resume_change"] = (m["resume"] - result["original_resume"]) / result["original_resume"] * 100
        rows.append(row)
    return rows


def run_table(result: dict) -> list[str]:
    raw = _mb(sum(result["sizes"]))
    lines = [f"### {result['run']}", f"{result['description']}. {len(result['sizes'])} checkpoints "
             f"({'folders' if result['unit'] == 'folder' else 'torch.save files'}), {raw:.1f} MB in all.", "",
             "| method | stored MB | ratio vs torch.save | size vs ZipNN | commit MB/s | speed vs ZipNN | "
             "checkout MB/s | peak extra MB commit / checkout | eval-loss change (worst) | resume eval-loss change |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in method_rows(result):
        lossy = "eval_change_max" in row
        change = f"{row['eval_change_max']:+.3f}%" if lossy else "bit-exact"
        resume = f"{row['resume_change']:+.3f}%" if lossy else "bit-exact"
        lines.append(
            f"| {row['method']} | {row['stored_mb']:.2f} | {row['ratio']:.2f}x | {row['vs_zipnn_size']:.2f}x | "
            f"{row['commit_mbs']:.0f} | {row['vs_zipnn_speed']:.2f}x | {row['checkout_mbs']:.0f} | "
            f"{row['commit_mem_mb']:.0f} / {row['checkout_mem_mb']:.0f} | {change} | {resume} |")
    lines.append("")
    lines.append(f"Held-out eval loss of the original checkpoints: "
                 f"{', '.join(f'{x:.4f}' for x in result['original_eval'])}; after {result['resume_steps']} more "
                 f"steps from the last one: {result['original_resume']:.4f}.")
    return lines


def plots(results: list[dict], folder: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    names = []
    figure, axes = plt.subplots(2, (len(results) + 1) // 2, figsize=(5 * ((len(results) + 1) // 2), 8), squeeze=False)
    for ax, result in zip(axes.flat, results):
        for name, m in result["methods"].items():
            ax.plot(result["steps"], [_mb(s) for s in m["stored"]], marker="o", markersize=3, label=name)
        ax.set_yscale("log")
        ax.set_title(result["run"])
        ax.set_xlabel("training step")
        ax.set_ylabel("MB stored by this commit")
        ax.grid(True, alpha=0.3)
    for ax in list(axes.flat)[len(results):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(folder / "stored-per-commit.png", dpi=90)
    plt.close(figure)
    names.append("stored-per-commit.png")

    figure, ax = plt.subplots(figsize=(9, 5.5))
    lossy = sorted({name for result in results for name, m in result["methods"].items() if m["lossy"]})
    markers = "osD^vP*X"
    for r, result in enumerate(results):
        for row in method_rows(result):
            if "eval_change_max" in row:
                color = f"C{lossy.index(row['method']) % 10}"
                ax.scatter(abs(row["eval_change_max"]), row["ratio"], color=color, marker=markers[r % len(markers)],
                           s=45, label=None)
    for i, name in enumerate(lossy):
        ax.scatter([], [], color=f"C{i % 10}", label=name)
    for r, result in enumerate(results):
        ax.scatter([], [], color="gray", marker=markers[r % len(markers)], label=result["run"])
    ax.set_xscale("symlog", linthresh=0.01)
    ax.set_xlabel("worst |eval-loss change| of a restored checkpoint (%)")
    ax.set_ylabel("total ratio vs torch.save")
    ax.set_title("Lossy methods: size against accuracy (colour: method, marker: run)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    figure.tight_layout()
    figure.savefig(folder / "ratio-vs-loss.png", dpi=90)
    plt.close(figure)
    names.append("ratio-vs-loss.png")
    return names


def write_report(header: dict, results: list[dict], out: Path) -> str:
    """Write the generated section of out/benchmarks.md (keeping text outside the markers) and plots."""
    images = plots(results, out / "img")
    lines = [BEGIN, "## Suite results (generated by `python -m bench`)", "",
             f"Machine: {header['machine']}; {header['versions']}. Command: `{header['command']}`; "
             f"the whole run took {header['seconds']} s.", ""]
    for result in results:
        lines += run_table(result) + [""]
    lines += [f"![{name}](img/{name})" for name in images] + [END]
    section = "\n".join(lines)
    target = out / "benchmarks.md"
    text = target.read_text() if target.exists() else "# Benchmarks\n"
    if BEGIN in text and END in text:
        text = text[: text.index(BEGIN)] + section + text[text.index(END) + len(END):]
    else:
        text = text.rstrip() + "\n\n" + section + "\n"
    target.write_text(text)
    return section
