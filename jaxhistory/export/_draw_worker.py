"""Draws a share of finalize's plots in a process of its own.

Run as ``python -m jaxhistory.export._draw_worker JOBS.pickle`` by
:func:`jaxhistory.export.to_png` when there are many plots; prints the path of
each plot as it is written.
"""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

from jaxhistory.export._mpl import _draw_job


def main(job_file: str) -> int:
    jobs = pickle.loads(Path(job_file).read_bytes())  # written by to_png
    for job in jobs:
        print(_draw_job(job), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
