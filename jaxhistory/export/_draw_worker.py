"""Draws a share of finalize's plots in a process of its own.

Started by :func:`jaxhistory.export.to_png` when there are many plots, as an
isolated interpreter (``python -I``: nothing from the working folder is
imported) that calls :func:`main` with the job file; prints the path of each
plot as it is written.
"""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

from jaxhistory.export._mpl import draw_job


def main(job_file: str) -> int:
    """Draws the jobs pickled in ``job_file`` (written by to_png)."""
    jobs = pickle.loads(Path(job_file).read_bytes())  # written by to_png
    for job in jobs:
        print(draw_job(job), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
