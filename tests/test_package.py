"""Packaging promises: light import, optional extras, documented public names."""

import doctest
import importlib
import importlib.metadata
import inspect
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import jaxhistory
from jaxhistory._optional import import_optional

ROOT = Path(__file__).resolve().parents[1]

HEAVY = (
    "matplotlib",
    "xarray",
    "netCDF4",
    "plotext",
    "flax",
    "optax",
    "psutil",
    "wandb",
    "tensorboardX",
)


def test_import_pulls_in_no_optional_or_heavy_package():
    code = (
        "import sys, jaxhistory\n"
        f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout


def test_missing_optional_package_names_the_pip_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "netCDF4", None)  # import now fails
    with pytest.raises(ImportError, match="pip install netCDF4") as info:
        import_optional("netCDF4", "writing dataset.nc")
    assert "writing dataset.nc" in str(info.value)


def test_missing_extra_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "flax", None)
    monkeypatch.setitem(sys.modules, "flax.nnx", None)  # imported by other tests
    with pytest.raises(ImportError, match=r"pip install 'jaxhistory\[nnx\]'"):
        import_optional("flax.nnx", "the nnx integration")


def test_present_optional_package_is_returned():
    assert import_optional("numpy", "anything") is importlib.import_module("numpy")


def test_every_public_name_exists_and_is_documented():
    for name in jaxhistory.__all__:
        obj = getattr(jaxhistory, name)
        if name.startswith("__") or not callable(obj):
            continue
        assert inspect.getdoc(obj), f"{name} has no docstring"


def test_public_functions_have_runnable_examples():
    functions = [
        getattr(jaxhistory, n)
        for n in jaxhistory.__all__
        if inspect.isfunction(getattr(jaxhistory, n))
    ]
    with_examples = [f.__name__ for f in functions if ">>>" in (f.__doc__ or "")]
    missing = {f.__name__ for f in functions} - set(with_examples)
    # These share the documented pattern of reduce_mean_collective.
    assert missing <= {
        "reduce_sum_collective",
        "reduce_max_collective",
        "reduce_min_collective",
        "reduce_std_collective",
    }, missing


@pytest.mark.parametrize(
    "module",
    [
        "_reduce",
        "_collective",
        "collective",
        "metrics",
        "_stats",
        "_hlo",
        "launch",
        "_history_state",
        "_buffer",
        "_history",
        "_names",
        "_codec",
        "_distributed",
        "sinks._jsonl",
        "sinks._csv",
        "sinks._named",
        "sinks._training_history",
        "_timing",
        "_env",
        "export._netcdf",
        "_results",
        "_memory",
        "_watch",
        "sentinels",
        "_quantiles",
        "_dtypes",
        "_row",
        "_views",
        "publish",
        "trace",
        "sinks",
        "sinks._tensorboard",
        "sinks._feed",
    ],
)
def test_docstring_examples_run(module):
    mod = importlib.import_module(f"jaxhistory.{module}")
    result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0, f"{module} has no docstring example"
    assert result.failed == 0


def test_every_exporter_is_documented():
    for name in jaxhistory.export.__all__:
        assert inspect.getdoc(getattr(jaxhistory.export, name)), name


def test_version_is_written_once():
    """The version lives in jaxhistory/_version.py alone: the installed
    distribution's metadata reads it from there."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in pyproject["project"]
    assert pyproject["project"]["dynamic"] == ["version"]
    assert importlib.metadata.version("jaxhistory") == jaxhistory.__version__


def test_ci_runs_lint_before_tests():
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert lines.index("make lint") < lines.index("make test")


@pytest.mark.parametrize(
    "old",
    [
        "reduce_mean_collective",
        "reduce_sum_collective",
        "reduce_max_collective",
        "reduce_min_collective",
        "reduce_std_collective",
        "reduce_custom_collective",
        "distributed_stats_collective",
    ],
)
def test_the_old_collective_names_warn_and_are_the_namespace_functions(old):
    new = old.removesuffix("_collective")
    with pytest.warns(DeprecationWarning, match=rf"jaxhistory.collective.{new}"):
        fn = getattr(jaxhistory, old)
    assert fn is getattr(jaxhistory.collective, new)
    assert old not in jaxhistory.__all__ and new in jaxhistory.collective.__all__


def test_an_unknown_attribute_is_still_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'reduce_median'"):
        jaxhistory.reduce_median  # noqa: B018


def test_every_collective_function_is_documented():
    for name in jaxhistory.collective.__all__:
        assert inspect.getdoc(getattr(jaxhistory.collective, name)), name


@pytest.mark.parametrize(
    ("namespace", "old"),
    [
        ("export", "file_stems"),
        ("export", "encode_netcdf"),
        ("export", "decode_netcdf"),
        ("export", "environment"),
        ("export", "new_run_id"),
        ("export", "md_escape"),
        ("export", "stats_table"),
        ("export", "summary_plots"),
        ("export", "plot_units"),
        ("export", "PlotUnit"),
        ("sinks", "is_sink"),
        ("sinks", "writes_here"),
    ],
)
def test_helpers_left_the_namespaces_and_warn_for_one_release(namespace, old):
    module = getattr(jaxhistory, namespace)
    assert old not in module.__all__
    with pytest.warns(DeprecationWarning, match=rf"jaxhistory.{namespace}.{old}"):
        assert callable(getattr(module, old))
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        module.nothing  # noqa: B018


def test_the_namespaces_export_what_users_call():
    assert set(jaxhistory.export.__all__) == {
        "JsonlStream",
        "finalize",
        "from_jsonl",
        "from_netcdf",
        "read_netcdf",
        "to_jsonl",
        "to_markdown",
        "to_netcdf",
        "to_png",
        "to_terminal",
    }
    assert "Record" in jaxhistory.sinks.__all__ and "Sink" in jaxhistory.sinks.__all__


def test_the_docs_site_has_a_reference_page_per_public_namespace():
    """Every public namespace has an API page that renders it from its
    docstrings, listed in the site's navigation."""
    root = Path(__file__).resolve().parents[1]
    config = (root / "mkdocs.yml").read_text()
    namespaces = [
        "jaxhistory",
        "jaxhistory.collective",
        "jaxhistory.metrics",
        "jaxhistory.sentinels",
        "jaxhistory.export",
        "jaxhistory.sinks",
        "jaxhistory.publish",
        "jaxhistory.trace",
    ]
    pages = {p.read_text(): p for p in (root / "docs" / "api").glob("*.md")}
    for name in namespaces:
        found = [p for text, p in pages.items() if f"\n::: {name}\n" in text]
        assert found, f"no API page renders {name}"
        assert f"api/{found[0].name}" in config, f"{found[0].name} is not in the nav"


def test_the_license_text_ships_with_the_distributions():
    """pyproject declares Apache-2.0 and names the file holding its text, which
    the wheel and the sdist then carry (a license-files pattern that matches
    nothing fails the build)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License\n" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text


def test_the_lower_bounds_of_the_dependencies_are_releases_that_work():
    """Each declared lower bound installs beside jax 0.10.2 (which needs numpy 2)
    and passes the tests: netCDF4 before 1.7 is compiled against numpy 1 (its
    import fails), and up to 1.7.2 a process whose dataset.nc write met a full
    disk crashes (SIGSEGV) as it exits; plotext 6.0 raises on a NaN in a terminal
    plot; matplotlib before 3.8.4 requires numpy<2."""
    from packaging.requirements import Requirement
    from packaging.version import Version

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lowest = {}
    for line in project["dependencies"]:
        req = Requirement(line)
        (spec,) = [s for s in req.specifier if s.operator == ">="]
        lowest[req.name] = Version(spec.version)
    assert lowest["netCDF4"] >= Version("1.7.3")
    assert lowest["plotext"] >= Version("6.1")
    assert lowest["numpy"] >= Version("2.0")
    assert lowest["matplotlib"] >= Version("3.8.4")
    assert lowest["jax"] >= Version("0.10.2")


def test_the_sdist_carries_the_tests_and_what_they_read():
    """The sdist ships the tests, so it ships the files they read from the
    repository root (MANIFEST.in), and the C source of the optional
    extension with the setup.py that builds it."""
    manifest = (ROOT / "MANIFEST.in").read_text().splitlines()
    entries = {
        name
        for line in manifest
        if line and not line.startswith("#")
        for name in line.split()[1:]
    }
    folders = {line.split()[1] for line in manifest if line.startswith("graft ")}
    read_by_tests = [".ci", "benchmarks", "docs", "examples", "notebooks"]
    read_by_tests += ["mkdocs.yml", "README.md", "pyproject.toml", "LICENSE"]
    for name in ["tests", "setup.py", "jaxhistory/_speedups.c", *read_by_tests]:
        assert (ROOT / name).exists(), name
        assert name in entries or name in folders, name
    assert "tests" in folders


def test_the_readme_example_says_which_extra_it_needs():
    """The first example imports flax and optax, which ``pip install jaxhistory``
    does not bring; the text before it names the extra that does."""
    readme = (ROOT / "README.md").read_text()
    before, block = readme.split("## Example", 1)[1].split("```python", 1)
    assert "from flax import nnx" in block and "import optax" in block
    assert "pip install 'jaxhistory[nnx]'" in before


@pytest.mark.parametrize("tool", ["ruff", "mypy"])
def test_the_lint_tools_are_pinned_to_one_minor_release(tool):
    """``make lint`` runs ``ruff format --check`` and ``mypy``; ruff's minor
    releases change its style and mypy's add checks, so an unpinned tool would
    fail CI on a new release with no change here. The dev extra holds each to
    one minor release."""
    from packaging.requirements import Requirement
    from packaging.version import Version

    dev = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]["dev"]
    (req,) = [Requirement(r) for r in dev if Requirement(r).name == tool]
    bounds = {s.operator: Version(s.version) for s in req.specifier}
    assert set(bounds) == {">=", "<"}, req
    low, high = bounds[">="], bounds["<"]
    assert (high.major, high.minor) == (low.major, low.minor + 1), req
    installed = Version(importlib.metadata.version(tool))
    assert installed in req.specifier


def test_the_package_says_it_is_typed():
    """The public functions are annotated; without a ``py.typed`` marker a
    type checker treats every jaxhistory name as Any (PEP 561)."""
    assert (ROOT / "jaxhistory" / "py.typed").is_file()
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]
    assert tool["setuptools"]["package-data"]["jaxhistory"] == ["py.typed"]
    # every package folder is listed (setuptools installs only those named)
    packages = {
        str(p.parent.relative_to(ROOT)).replace("/", ".")
        for p in (ROOT / "jaxhistory").rglob("__init__.py")
    }
    assert set(tool["setuptools"]["packages"]) == packages
