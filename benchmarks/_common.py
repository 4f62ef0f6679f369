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


def report(info: str, quick: bool, sections: list[str], out: Path | None) -> str:
    """Prints the report (machine line, mode, sections) and writes it to ``out``."""
    text = f"{info}\n{'--quick' if quick else 'full run'}\n\n" + "\n".join(sections)
    print(text, flush=True)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
        print(f"\nwrote {out}")
    return text
