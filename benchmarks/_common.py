"""Shared by the benchmark scripts: the machine line and the report file."""

import os
import platform
from pathlib import Path

import jax


def machine_info() -> str:
    """jax and Python versions, devices, platform and CPU count, on one line."""
    return (
        f"jax {jax.__version__}, python {platform.python_version()}, "
        f"{jax.device_count()} devices, platform {jax.default_backend()}, "
        f"os.cpu_count()={os.cpu_count()}"
    )


def report(
    info: str,
    quick: bool,
    sections: list[str],
    out: Path | None,
    seconds: float | None = None,
) -> str:
    """Prints the report (machine line, mode and how long it took, sections)
    and writes it to ``out``."""
    mode = "--quick" if quick else "full run"
    if seconds is not None:
        mode += f", {seconds:.0f} s in all"
    text = f"{info}\n{mode}\n\n" + "\n".join(sections)
    print(text, flush=True)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
        print(f"\nwrote {out}")
    return text
