"""Builds the compiled host-path helpers (``jaxhistory/_speedups.c``).

Everything else is declared in pyproject.toml. The extension is optional:
where it cannot be built (no C compiler), jaxhistory installs and runs the
same steps as Python.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "jaxhistory._speedups",
            ["jaxhistory/_speedups.c"],
            optional=True,
        )
    ]
)
