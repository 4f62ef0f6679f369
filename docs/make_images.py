"""Makes the images the docs pages show (run by ``make docs`` before the build).

* ``images/demo_*.png``: plots of a short run of ``examples/demo.py`` (the train
  vs eval loss, the gradient norm per layer);
* ``images/bench_reducers.png``: time per call against the number of metrics,
  from ``benchmarks/results/reducers.md`` (written by ``make bench``).

Usage: ``python docs/make_images.py [--steps 60]``. Writes into ``docs/images/``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
IMAGES = ROOT / "docs" / "images"
DEMO_PLOTS = {
    "loss_train_vs_eval.png": "demo_train_vs_eval.png",
    "grads_norm.layers.png": "demo_grads_norm_layers.png",
}


MADE = [*DEMO_PLOTS.values(), "bench_reducers.png"]  # every image made here


def demo_images(steps: int) -> None:
    """Runs the demo for ``steps`` steps and copies the plots the pages show."""
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, JAX_NUM_CPU_DEVICES="8", MPLBACKEND="Agg")
        subprocess.run(
            [
                sys.executable,
                str(ROOT / "examples" / "demo.py"),
                f"--steps={steps}",
                "--log-every=10",
                f"--outdir={tmp}",
            ],
            check=True,
            env=env,
            stdout=subprocess.DEVNULL,
        )
        plots = Path(tmp) / "plots" / "mplot"
        for source, target in DEMO_PLOTS.items():
            shutil.copyfile(plots / source, IMAGES / target)


def markdown_table(path: Path) -> list[dict[str, str]]:
    """The first table of a markdown file, as one dict per row."""
    rows = [
        [cell.strip() for cell in line.strip().strip("|").split("|")]
        for line in path.read_text().splitlines()
        if line.startswith("|")
    ]
    header, body = rows[0], [r for r in rows[2:] if len(r) == len(rows[0])]
    return [dict(zip(header, r, strict=True)) for r in body]


def bench_image() -> None:
    """Median time per call of each implementation against K, log-log."""
    import matplotlib.pyplot as plt

    rows = markdown_table(ROOT / "benchmarks" / "results" / "reducers.md")
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    for impl in dict.fromkeys(r["implementation"] for r in rows):
        mine = [r for r in rows if r["implementation"] == impl]
        ks = [int(r["K"]) for r in mine]
        us = [float(r["median µs/call"]) for r in mine]
        ax.plot(ks, us, marker="o", label=impl, lw=2.5 if impl == "fused" else 1.2)
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="metrics K (one value per device each)",
        ylabel="median µs per call",
        title="mean/max/min/std of K metrics across 8 devices",
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(IMAGES / "bench_reducers.png")
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="demo steps")
    args = parser.parse_args()
    IMAGES.mkdir(parents=True, exist_ok=True)
    bench_image()
    demo_images(args.steps)


if __name__ == "__main__":
    main()
