"""HistoryState <-> xarray.Dataset and the dataset file (jaxhistory._xarray): names
the dataset uses itself, sparse metrics in one long table, a group per metric path
with its step coordinate, and damaged files named with their cause."""

import math
import re

import numpy as np
import pytest
from test_history_state import key_sets

import jaxhistory as jh
from jaxhistory import export
from jaxhistory.cli import load_run

# ----- names that collide with the dataset's own ------------------------------------


def hostile_state():
    s = jh.HistoryState()
    long = "m" * 250
    s = s.update({"_recorded": 1.0, "_metric": 2.0, "x": np.arange(2.0)}, step=0)
    s = s.update({"x_dim_0": 3.0, long: 4.0, f"{long}/w": np.ones(3)}, step=1)
    s = s.update({"_recorded": math.nan, "x_dim_0": 5.0}, step=3)  # gaps and NaN
    return s


def assert_same(a, b):
    assert sorted(a.keys) == sorted(b.keys)
    for name in a.keys:
        assert a.steps(name).tolist() == b.steps(name).tolist(), name
        np.testing.assert_array_equal(a.values(name), b.values(name), err_msg=name)
        assert a.values(name).dtype == b.values(name).dtype, name


def test_names_the_dataset_uses_round_trip_through_xarray():
    s = hostile_state()
    assert_same(s, jh.HistoryState.from_xarray(s.to_xarray()))


def test_names_the_dataset_uses_round_trip_through_netcdf(tmp_path):
    s = hostile_state()
    export.to_netcdf(s, tmp_path / "d.nc")
    back = jh.HistoryState.from_netcdf(tmp_path / "d.nc")
    assert_same(s, back)
    names = set(export.read_netcdf(tmp_path / "d.nc").data_vars)
    assert "m" * 250 in names and "_recorded" in names


def test_a_metric_named_like_the_mask_with_gaps_and_no_nan_round_trips(tmp_path):
    s = jh.HistoryState().update({"_recorded": 1.0, "y": 1.0}, step=0)
    s = s.update({"y": 2.0}, step=1).update({"_recorded": 3.0, "y": 2.0}, step=2)
    back = jh.HistoryState.from_xarray(s.to_xarray())
    assert_same(s, back)
    assert back.steps("_recorded").tolist() == [0, 2]
    export.to_netcdf(s, tmp_path / "d.nc")
    assert_same(s, jh.HistoryState.from_netcdf(tmp_path / "d.nc"))


# ----- sparse metrics in bulk: one long table ---------------------------------------


def test_sparse_metrics_in_bulk_go_to_one_long_table(tmp_path):
    from jaxhistory import _xarray

    n = 400  # > LONG_FROM sparse metrics
    s = key_sets(n)
    s = s.update({"sample/0": math.nan, "count/7": 2**53}, step=n)  # NaN, ints
    s = s.update({"sample/1": -math.inf, "w": np.ones(2)}, step=n + 1)
    ds = s.to_xarray()
    # Dense: loss and the array metric; the rest is one table of records.
    assert set(ds.data_vars) == {
        "loss",
        "w",
        "_long_step",
        "_long_index",
        "_long_value",
        "_long_dtype",
    }
    assert ds.sizes["_long"] == n + 3 and ds.sizes["_long_metric"] == n + 1
    assert ds.attrs[_xarray.LONG_ATTR].split(",")[2] == "_long_step"
    back = jh.HistoryState.from_xarray(ds)
    assert_same(s, back)
    assert back.dtype("count/7") == np.int64
    path = tmp_path / "dataset.nc"
    export.to_netcdf(s, path)
    assert_same(s, jh.HistoryState.from_netcdf(path))
    assert path.stat().st_size < 200_000  # not a 400 x 400 table of NaN
    # Warmup drops the first steps from the long table too (as from the others:
    # a metric all in the warmup keeps its name and no records).
    kept = jh.HistoryState.from_xarray(s.to_xarray(warmup=300))
    assert kept.steps("sample/299").tolist() == [] and kept.count("loss") == n - 300
    assert kept.values("sample/300").tolist() == [300.0]


def test_a_few_sparse_metrics_stay_variables_of_their_own():
    ds = key_sets(20).to_xarray()
    assert "sample/3" in ds.data_vars and "_long_value" not in ds.data_vars


def test_the_long_table_never_takes_a_metrics_name():
    s = key_sets(300).update({"_long_step": 1.0, "_long": 2.0}, step=300)
    ds = s.to_xarray()
    names = ds.attrs["jaxhistory_long"].split(",")
    assert names[0] == "_long_" and names[2] == "_long_step_"
    assert_same(s, jh.HistoryState.from_xarray(ds))


def test_a_damaged_long_table_is_named():
    ds = key_sets(300).to_xarray()
    ds.attrs["jaxhistory_long"] = "a,b"
    with pytest.raises(ValueError, match="does not name its long table"):
        jh.HistoryState.from_xarray(ds)


def long_run():
    s = key_sets(300)
    return s.to_xarray()


@pytest.mark.parametrize("fault", ["repeat", "backwards", "also a variable"])
def test_a_damaged_long_table_in_a_file_is_named(tmp_path, fault):
    ds = long_run()
    steps = ds["_long_step"].values.copy()
    index = ds["_long_index"].values.copy()
    if fault == "also a variable":
        metrics = ds["_long_metric"].values.copy()
        metrics[0] = "loss"
        ds = ds.assign_coords(_long_metric=metrics)
        match = "'loss'.*both"
    else:
        # give metric 0 two records: the step of metric 1's record, or an earlier one
        index[1] = index[0]
        steps[1] = steps[0] if fault == "repeat" else steps[0] - 1
        ds["_long_step"] = ("_long", steps)
        ds["_long_index"] = ("_long", index)
        match = "'sample/0'.*strictly increasing"
    with pytest.raises(ValueError, match=match):
        jh.HistoryState.from_xarray(ds)
    path = tmp_path / "long.nc"
    ds.to_netcdf(path, engine="netcdf4")
    with pytest.raises(ValueError, match=f"long.nc.*{match}"):
        jh.HistoryState.from_netcdf(path)


# ----- the dataset file: a group per metric path, each with its step coordinate -----


def eval_run():
    """train/loss every step 0..100, eval/loss every 50 steps (NaN between)."""
    s = jh.HistoryState()
    for t in range(101):
        s = s.update({"train": {"loss": 1.0 / (t + 1)}}, step=t)
        if t % 50 == 0:
            s = s.update({"eval": {"loss": 0.2014 + t}}, step=t)
    return s


def test_every_group_of_the_dataset_file_opens_with_its_step_coordinate(tmp_path):
    import xarray as xr

    path = tmp_path / "dataset.nc"
    export.to_netcdf(eval_run(), path)
    with xr.open_dataset(path, group="eval") as ds:
        assert "step" in ds.coords and ds["step"].values.tolist() == list(range(101))
        assert float(ds["loss"].sel(step=50)) == 0.2014 + 50
        assert np.isnan(float(ds["loss"].sel(step=51)))
    with xr.open_dataset(path, group="train") as ds:
        assert float(ds["loss"].sel(step=3)) == 0.25
    with xr.open_datatree(path) as tree:
        assert float(tree["eval"]["loss"].sel(step=100)) == 100.2014
        assert float(tree["eval/loss"].sel(step=0)) == 0.2014
    assert_same(eval_run(), jh.HistoryState.from_netcdf(path))


def test_a_nested_group_has_its_step_coordinate(tmp_path):
    import xarray as xr

    s = jh.HistoryState().update({"a": {"b": {"c": 1.0}}, "d": 0.5}, step=4)
    s = s.update({"a": {"b": {"c": 2.0}}}, step=9)
    path = tmp_path / "dataset.nc"
    export.to_netcdf(s, path, timestamps={4: 1.7e9, 9: 1.7e9 + 5})
    for group in ("a", "a/b"):
        with xr.open_dataset(path, group=group) as ds:
            assert ds["step"].values.tolist() == [4, 9], group
    with xr.open_dataset(path, group="a/b") as ds:
        assert float(ds["c"].sel(step=9)) == 2.0
    with xr.open_datatree(path) as tree:  # time: in the root group
        assert str(tree["time"].values[1])[:19] == "2023-11-14T22:13:25"
    assert_same(s, jh.HistoryState.from_netcdf(path))


# ----- files read back as they were written, or refused -----------------------------


def test_a_damaged_dataset_file_is_named_with_its_cause(tmp_path):
    s = jh.HistoryState()
    for i in range(500):
        s = s.update({"a": float(i)})
    export.to_netcdf(s, tmp_path / "good.nc")
    data = (tmp_path / "good.nc").read_bytes()
    (tmp_path / "cut.nc").write_bytes(data[: len(data) // 2])
    (tmp_path / "junk.nc").write_bytes(b"\x00\x01 not a dataset")
    for name in ("cut.nc", "junk.nc"):
        with pytest.raises(OSError, match=f"cannot read the dataset .*{name}"):
            jh.HistoryState.from_netcdf(tmp_path / name)


def crafted(tmp_path, name, edit):
    """A dataset file of a small run, changed by ``edit(ds)`` and written flat."""
    s = jh.HistoryState().update({"a": 1.0, "i": 1}, step=0)
    s = s.update({"a": 2.0, "i": 2}, step=1).update({"a": 3.0}, step=2)
    ds = edit(s.to_xarray())
    path = tmp_path / name
    ds.to_netcdf(path, engine="netcdf4")
    return path


@pytest.mark.parametrize(
    "steps, what",
    [
        ([2, 1, 0], "strictly increasing"),
        ([0, 1, 1], "strictly increasing"),
        ([0.0, 0.5, 1.0], "whole numbers"),
    ],
)
def test_a_dataset_file_whose_steps_are_not_steps_is_named(tmp_path, steps, what):
    path = crafted(tmp_path, "bad.nc", lambda ds: ds.assign_coords(step=steps))
    with pytest.raises(ValueError, match=f"{path.name}.*step.*{what}"):
        jh.HistoryState.from_netcdf(path)
    with pytest.raises(ValueError, match=f"{path.name}.*step.*{what}"):
        load_run(path)


@pytest.mark.parametrize("dtype", ["object", "<U5", "V8", "V100000000", "M8[ns]"])
def test_a_dataset_file_with_a_dtype_that_is_no_number_is_named(tmp_path, dtype):
    def edit(ds):
        ds["a"].attrs["jaxhistory_dtype"] = dtype
        return ds

    path = crafted(tmp_path, "dtype.nc", edit)
    with pytest.raises(
        ValueError, match=rf"dtype.nc.*'a'.*{re.escape(dtype)}.*not a numeric"
    ):
        jh.HistoryState.from_netcdf(path)


def test_an_unreadable_dtype_attribute_is_named(tmp_path):
    def edit(ds):
        ds["i"].attrs["jaxhistory_dtype"] = "int65"
        return ds

    path = crafted(tmp_path, "dtype.nc", edit)
    with pytest.raises(ValueError, match="dtype.nc.*'i'.*int65"):
        jh.HistoryState.from_netcdf(path)


def _masked_run():
    """a, i and c/d; c/d has gaps and records a NaN, so the file has a mask."""
    s = jh.HistoryState().update({"a": 1.0, "i": 1, "c/d": 3.0}, step=0)
    s = s.update({"a": 2.0, "i": 2}, step=1)
    return s.update({"a": 9.0, "c/d": np.nan}, step=3).update({"a": 3.0}, step=5)


# (where: "/" for the dataset, else the variable's path; the attribute; its
# value; what the message says of it)
CRAFTED_ATTRIBUTES = [
    ("/", "jaxhistory_next_step", [1, 2], "not a whole number"),
    ("/", "jaxhistory_next_step", "abc", "not a whole number"),
    ("/", "jaxhistory_next_step", 2.5, "not a whole number"),
    ("/", "jaxhistory_next_step", 2.0**70, "not a whole number"),
    ("/", "jaxhistory_mask", [1, 2], "not text"),
    ("/", "jaxhistory_mask", 5, "not text"),
    ("/", "jaxhistory_mask", "a", "no mask"),
    ("/", "jaxhistory_mask_dim", 5, "not text"),
    ("/", "jaxhistory_mask_dim", "zz", "no mask"),
    ("/", "jaxhistory_mask_dim", "step", "no mask"),
    ("/", "jaxhistory_long", 5, "not text"),
    ("/", "jaxhistory_long", ["a", "b"], "not text"),
    ("/", "jaxhistory_layout", ["groups", "x"], "not text"),
    ("/", "jaxhistory_layout", 5, "not text"),
    ("/", "jaxhistory_layout", "other", "not 'groups'"),
    ("a", "jaxhistory_name", [1, 2], "not text"),
    ("a", "jaxhistory_name", 5, "not text"),
    ("c/d", "jaxhistory_name", ["a", "b"], "not text"),
    ("a", "jaxhistory_order", "x", "not a whole number"),
    ("c/d", "jaxhistory_order", [1, 2], "not a whole number"),
    ("a", "jaxhistory_order", 1.5, "not a whole number"),
    ("a", "jaxhistory_dtype", [1, 2], "not text"),
    ("c/d", "jaxhistory_dtype", 5, "not text"),
    ("a", "jaxhistory_gaps", "yes", "not 0 or 1"),
    ("c/d", "jaxhistory_gaps", [1, 0], "not 0 or 1"),
    ("a", "jaxhistory_gaps", 2, "not 0 or 1"),
]


@pytest.mark.parametrize("where, attribute, value, said", CRAFTED_ATTRIBUTES)
def test_an_attribute_of_the_wrong_type_is_named_with_the_file(
    tmp_path, where, attribute, value, said
):
    """Each attribute the loader reads, given a value of the wrong type (or
    naming nothing it could be): TypeError, KeyError, IndexError or an error
    naming neither the attribute nor the file, or a file read wrongly (a
    mask read as a metric, a group left out, a name of '[1 2]'), before. A
    ValueError names the file, the attribute and the variable."""
    import xarray as xr

    export.to_netcdf(_masked_run(), tmp_path / "good.nc")
    tree = xr.open_datatree(tmp_path / "good.nc").load()
    assert "_recorded" in tree.data_vars  # the mask the attributes name
    (tree if where == "/" else tree[where]).attrs[attribute] = value
    path = tmp_path / "crafted.nc"
    tree.to_netcdf(path)
    for load in (jh.HistoryState.from_netcdf, export.read_netcdf, load_run):
        if load is export.read_netcdf and attribute in _READ_LATER:
            continue  # (read by from_netcdf, not by read_netcdf)
        with pytest.raises(ValueError) as info:
            load(path)
        message = str(info.value)
        assert message.startswith(f"{path}: "), message
        assert attribute in message and said in message, message
        if where != "/":
            assert f"'{where}'" in message, message
    assert_same(_masked_run(), jh.HistoryState.from_netcdf(tmp_path / "good.nc"))


# what read_netcdf returns as it is, for from_dataset to read
_READ_LATER = {"jaxhistory_next_step", "jaxhistory_dtype", "jaxhistory_gaps"}


@pytest.mark.parametrize(
    "variable, attribute, value, said",
    [
        (None, "jaxhistory_next_step", [1, 2], "not a whole number"),
        (None, "jaxhistory_mask", 5, "not text"),
        (None, "jaxhistory_long", [1, 2], "not text"),
        ("a", "jaxhistory_name", [1, 2], "not text"),
        ("a", "jaxhistory_gaps", "yes", "not 0 or 1"),
        ("i", "jaxhistory_dtype", 5, "not text"),
    ],
)
def test_an_attribute_of_the_wrong_type_in_a_flat_file_is_named(
    tmp_path, variable, attribute, value, said
):
    """The earlier flat layout, and a dataset in memory (from_xarray)."""

    def edit(ds):
        (ds if variable is None else ds[variable]).attrs[attribute] = value
        return ds

    path = crafted(tmp_path, "flat.nc", edit)
    with pytest.raises(ValueError) as info:
        jh.HistoryState.from_netcdf(path)
    message = str(info.value)
    assert message.startswith(f"{path}: ") and attribute in message, message
    assert said in message and (variable is None or f"'{variable}'" in message)
    if attribute == "jaxhistory_name":
        return  # a name in a file only: a dataset in memory names its metrics
    ds = edit(jh.HistoryState().update({"a": 1.0, "i": 1}, step=0).to_xarray())
    with pytest.raises(ValueError, match=f"{attribute}.*{said}"):
        jh.HistoryState.from_xarray(ds)


# ----- times, plain xarray, names that cannot be groups, the flat layout ------------


def test_the_dataset_has_the_wall_clock_time_of_each_step(tmp_path):
    import xarray as xr

    h = jh.History(distributed_history=False, jsonl_path=tmp_path / "run.jsonl")
    for i in range(5):
        h.update({"loss": 1.0 / (i + 1), "time": float(i)}, summarize=False)
    h.finalize(tmp_path / "out", plot=False)
    h.close()
    with xr.open_dataset(tmp_path / "out" / "dataset.nc") as ds:  # plain xarray
        times = ds["time_"].values  # "time" is a metric here
        assert times.dtype.kind == "M" and len(times) == 5
        assert np.all(np.diff(times.astype("int64")) >= 0)
        year = times[0].astype("datetime64[Y]").astype(int) + 1970
        assert year >= 2024
    back = jh.HistoryState.from_netcdf(tmp_path / "out" / "dataset.nc")
    assert back.values("time").tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    s = jh.HistoryState().update({"loss": 1.0}, step=3)
    export.to_netcdf(s, tmp_path / "no_times.nc")  # no timestamps: no coordinate
    with xr.open_dataset(tmp_path / "no_times.nc") as ds:
        assert "time" not in ds.coords


def test_plain_xarray_reads_each_metric_by_its_path(tmp_path):
    """Finding: ``xr.open_dataset`` named variables ``train%2Floss%2Fmean``, and
    ``ds["train/loss/mean"]`` raised KeyError. Each metric path is now a group."""
    import xarray as xr

    h = jh.History(distributed_history=False, jsonl_path=tmp_path / "run.jsonl")
    for i in range(4):
        stats = {"mean": 1.0 / (i + 1), "std": 0.1, "min": 0.5, "max": 2.0}
        h.update({"train": {"loss": stats}, "lr": 1e-3}, summarize=False)
        if i % 2:
            h.update({"eval/loss": 0.7}, step=i, summarize=False)
    h.finalize(tmp_path / "out", plot=False)
    h.close()
    path = tmp_path / "out" / "dataset.nc"
    with xr.open_datatree(path) as tree:  # plain xarray, no jaxhistory call
        mean = tree["train/loss/mean"]
        assert mean.values.tolist() == [1.0, 0.5, 1 / 3, 0.25]
        assert mean.attrs["long_name"] == "train/loss/mean"
        group = tree["train/loss"].to_dataset()
        assert set(group.data_vars) == {"mean", "std", "min", "max"}
        assert group["max"].dims == ("step",)
        assert tree["time"].dtype.kind == "M" and tree["time"].dims == ("step",)
        assert group.coords["step"].values.tolist() == [0, 1, 2, 3]
        eval_loss = tree["eval/loss"].values
        assert np.isnan(eval_loss[0]) and eval_loss[1] == 0.7
    with xr.open_dataset(path, group="train/loss") as ds:
        assert ds["std"].values.tolist() == [0.1] * 4
    with xr.open_dataset(path) as ds:  # the root: metrics without a "/"
        assert ds["lr"].values.tolist() == [1e-3] * 4
        assert ds.attrs["jaxhistory_layout"] == "groups"


def test_the_dataset_file_keeps_names_that_cannot_be_groups(tmp_path):
    """A metric ``loss`` beside ``loss/std`` (netCDF has one namespace for groups
    and variables), ``x/step`` (the coordinate), empty or over-long parts: each
    round-trips exactly, in the history's order."""
    import xarray as xr

    names = ["loss/std", "loss", "x/step", "step/x", "a//b", "/a", "a/", "é/ü"]
    names += ["p" * 300 + "/y", "z/" + "q" * 300, "t/arr", "arr", "%2F/_x"]
    # found in review: a group named like a coordinate below the root; names
    # that reach netCDF's 255 bytes once made free or given a dimension; the
    # same name in two Unicode forms (netCDF stores NFC)
    names += ["a/step/x", "b/c/time/x", "M" * 255, "M" * 255 + "/x"]
    names += ["e\u0301", "\u00e9", "n/e\u0301/x", "L" * 250]
    s = jh.HistoryState()
    for i in range(3):
        row = {n: float(i + k) for k, n in enumerate(names)}
        row["t/arr"] = np.ones((2, 2)) * i
        row["arr"] = np.arange(3.0) + i
        row["L" * 250] = np.arange(2.0) + i  # its dimension's name is too long
        s = s.update(row, step=i)
    export.to_netcdf(s, tmp_path / "d.nc", timestamps={0: 1e9, 1: 1e9 + 1})
    back = jh.HistoryState.from_netcdf(tmp_path / "d.nc")
    assert back.keys == s.keys
    for name in names:
        np.testing.assert_array_equal(back.values(name), s.values(name), name)
    with xr.open_datatree(tmp_path / "d.nc") as tree:
        assert tree["loss/std"].values.tolist() == [0.0, 1.0, 2.0]
        assert tree["loss_"].attrs["jaxhistory_name"] == "loss"
        assert tree["x/step_"].attrs["jaxhistory_name"] == "x/step"
        assert tree["t/arr"].shape == (3, 2, 2) and tree["arr"].shape == (3, 3)
    flat = export.read_netcdf(tmp_path / "d.nc")
    assert flat["t/arr"].dims == ("step", "t/arr_dim_0", "t/arr_dim_1")
    assert flat["L" * 250].dims == s.to_xarray()["L" * 250].dims  # as in memory


def _three_metrics():
    s = jh.HistoryState().update({"a": 1.0, "b": 2.0, "c/d": 3.0}, step=0)
    return s.update({"a": 1.5, "b": 2.5, "c/d": 3.5}, step=1)


@pytest.mark.parametrize(
    "names, first, second, metric",
    [
        ({"a": "dup", "b": "dup"}, "a", "b", "dup"),  # both named by the attribute
        ({"b": "a"}, "a", "b", "a"),  # the attribute names another's metric
        ({"c/d": "b"}, "b", "c/d", "b"),  # one in a group
        ({"a": "_recorded"}, "_recorded", "a", "_recorded"),  # the mask's name
        ({"c/d": "step"}, "c/d", "step", "step"),  # the coordinate's
        ({"a": "x\x1b[2J"}, None, None, None),  # (one name: read as it says)
    ],
)
def test_two_variables_holding_one_metric_are_refused(
    tmp_path, names, first, second, metric
):
    """Two variables of a dataset file whose jaxhistory_name attributes (or
    paths) give one metric name: one of them was dropped without a word. A
    ValueError names both variables, the metric and the file."""
    import xarray as xr

    s = _three_metrics().update({"b": np.nan}, step=3).update({"a": 4.0}, step=4)
    # (b has gaps and a NaN: the file holds the mask _recorded)
    export.to_netcdf(s, tmp_path / "d.nc")
    tree = xr.open_datatree(tmp_path / "d.nc").load()
    assert "_recorded" in tree.data_vars
    for variable, name in names.items():
        tree[variable].attrs["jaxhistory_name"] = name
    path = tmp_path / "twice.nc"
    tree.to_netcdf(path)
    if metric is None:  # a name of its own, escaped control characters and all
        assert jh.HistoryState.from_netcdf(path).keys == ("x\x1b[2J", "b", "c/d")
        return
    for load in (jh.HistoryState.from_netcdf, export.read_netcdf, load_run):
        with pytest.raises(ValueError) as info:
            load(path)
        message = str(info.value)
        assert message.startswith(f"{path}: "), message
        assert f"variables '{first}' and '{second}'" in message, message
        assert f"metric '{metric}'" in message, message


def test_two_variables_of_a_flat_file_holding_one_metric_are_refused(tmp_path):
    """The earlier flat layout: two variables whose jaxhistory_name (or
    encoded name) is one metric failed inside xarray ('the new name conflicts'),
    naming no file."""
    s = jh.HistoryState().update({"a": 1.0, "b": 2.0, "c": 3.0}, step=0)
    cases = [
        ({"a": "dup", "b": "dup"}, {}, "'a' and 'b'", "'dup'"),
        ({"c": "a"}, {}, "'a' and 'c'", "'a'"),
        ({"b": "x/y"}, {"c": "x%2Fy"}, "'b' and 'x%2Fy'", "'x/y'"),
        ({"b": "step"}, {}, "'b' and 'step'", "'step'"),
    ]
    for number, (named, renames, variables, metric) in enumerate(cases):
        ds = s.to_xarray().rename(renames)
        for variable, name in named.items():
            ds[variable].attrs["jaxhistory_name"] = name
        path = tmp_path / f"flat{number}.nc"
        ds.to_netcdf(path, engine="netcdf4")
        with pytest.raises(ValueError) as info:
            jh.HistoryState.from_netcdf(path)
        message = str(info.value)
        assert message.startswith(f"{path}: "), message
        assert f"variables {variables}" in message, message
        assert f"metric {metric}" in message, message


def test_a_dataset_file_of_the_earlier_flat_layout_still_reads(tmp_path):
    import xarray as xr

    ds = xr.Dataset(
        {"train%2Floss": ("step", [0.5, 0.25]), "lr": ("step", [1.0, 1.0])},
        coords={"step": [0, 1]},
        attrs={"jaxhistory_next_step": 2},
    )
    ds.to_netcdf(tmp_path / "old.nc", engine="netcdf4")
    back = jh.HistoryState.from_netcdf(tmp_path / "old.nc")
    assert set(back.keys) == {"train/loss", "lr"}
    assert back.values("train/loss").tolist() == [0.5, 0.25]


def test_a_mask_of_the_wrong_shape_is_named_with_the_file(tmp_path):
    """A mask (the variable jaxhistory_mask names) with fewer columns than the
    names of its dimension's coordinate: an IndexError before. A ValueError
    names the variable, its shape, the shape expected and the file."""
    import netCDF4

    path = tmp_path / "mask.nc"
    export.to_netcdf(_masked_run(), path)
    with netCDF4.Dataset(path, "a") as nc:
        nc.createDimension("zz", 1)
        nc.createVariable("mask2", "i1", ("step", "zz"))[:] = np.ones((4, 1))
        names = nc.createVariable("zz", str, ("step",))  # 4 names, 1 column
        names[:] = np.array(["a", "i", "c/d", "x"], object)
        nc.setncattr("jaxhistory_mask", "mask2")
        nc.setncattr("jaxhistory_mask_dim", "zz")
    for load in (jh.HistoryState.from_netcdf, load_run):
        with pytest.raises(ValueError) as info:
            load(path)
        message = str(info.value)
        assert message.startswith(f"{path}: "), message
        assert "'mask2'" in message and "jaxhistory_mask" in message, message
        assert "(4, 1), not (4, 4)" in message and "'zz'" in message, message


def test_a_flat_file_with_groups_is_refused_naming_them(tmp_path):
    """A file without jaxhistory_layout is of the earlier flat layout, which
    has no groups: the variables of a group in one were silently left out.
    A ValueError names the file and the groups holding variables; the same
    file with the layout attribute reads whole."""
    import xarray as xr

    flat = jh.HistoryState().update({"a": 1.0}, step=0).update({"a": 2.0}, step=1)
    tree = xr.DataTree.from_dict(
        {
            "/": flat.to_xarray(),
            "/eval": xr.Dataset({"loss": ("step", [0.5, 0.25])}),
            "/x/y": xr.Dataset({"z": ("step", [1.0, 2.0])}),
            "/empty": xr.Dataset(),
        }
    )
    path = tmp_path / "flat.nc"
    tree.to_netcdf(path, engine="netcdf4")
    for load in (jh.HistoryState.from_netcdf, export.read_netcdf, load_run):
        with pytest.raises(ValueError) as info:
            load(path)
        message = str(info.value)
        assert message.startswith(f"{path}: "), message
        assert "'eval'" in message and "'x/y'" in message, message
        assert "'empty'" not in message and "jaxhistory_layout" in message, message
    tree.attrs["jaxhistory_layout"] = "groups"
    tree.to_netcdf(tmp_path / "grouped.nc", engine="netcdf4")
    back = jh.HistoryState.from_netcdf(tmp_path / "grouped.nc")
    assert back.values("eval/loss").tolist() == [0.5, 0.25]
    assert back.values("x/y/z").tolist() == [1.0, 2.0]


@pytest.mark.parametrize("next_step", [5, 3, -7])
def test_a_next_step_at_or_before_the_last_step_is_refused(tmp_path, next_step):
    """_masked_run's last step is 5: a jaxhistory_next_step of 5 or less was
    read, and the state's next update (at next_step) was then refused or
    placed before recorded steps. A ValueError names the attribute, its
    value, the last step and the file; a later next_step still reads."""
    import xarray as xr

    export.to_netcdf(_masked_run(), tmp_path / "good.nc")
    tree = xr.open_datatree(tmp_path / "good.nc").load()
    for value, name in ((next_step, "bad.nc"), (9, "later.nc")):
        tree.attrs["jaxhistory_next_step"] = value
        tree.to_netcdf(tmp_path / name)
    path = tmp_path / "bad.nc"
    for load in (jh.HistoryState.from_netcdf, load_run):
        with pytest.raises(ValueError) as info:
            load(path)
        message = str(info.value)
        assert message.startswith(f"{path}: "), message
        assert f"jaxhistory_next_step attribute is {next_step}" in message, message
        assert "last step 5" in message, message
    ds = _masked_run().to_xarray()
    ds.attrs["jaxhistory_next_step"] = next_step
    with pytest.raises(ValueError, match=f"is {next_step}.*last step 5"):
        jh.HistoryState.from_xarray(ds)
    later = jh.HistoryState.from_netcdf(tmp_path / "later.nc")
    assert later.next_step == 9
    assert later.update({"a": 4.0}).steps("a").tolist() == [0, 1, 3, 5, 9]


def test_the_long_tables_steps_count_for_the_last_step():
    """A metric of the long table recorded past the step coordinate (a crafted
    dataset) also bounds next_step from below."""
    ds = long_run()
    steps = ds["_long_step"].values.copy()
    steps[-1] = 10**6  # the last record of the table's last metric
    ds["_long_step"] = ("_long", steps)
    ds.attrs["jaxhistory_next_step"] = int(ds["step"].values[-1]) + 1
    said = r"next_step attribute is \d+.*last step 1000000"
    with pytest.raises(ValueError, match=said):
        jh.HistoryState.from_xarray(ds)
    ds.attrs["jaxhistory_next_step"] = 10**6 + 1
    assert jh.HistoryState.from_xarray(ds).next_step == 10**6 + 1


def test_a_state_recorded_up_to_the_last_int64_step_reads_back(tmp_path):
    """A state whose last step is 2**63 - 1 has next_step 2**63 (nothing
    more can be recorded); its own dataset and file were refused on reading
    (next_step "not a whole number within int64"). Both read back, with the
    same values and the same next step, and an update is still refused."""
    top = 2**63 - 1
    state = jh.HistoryState().update({"loss": 1.0}, step=top)
    assert state.next_step == top + 1
    ds = state.to_xarray()
    ds.to_netcdf(tmp_path / "full.nc")
    for back in (
        jh.HistoryState.from_xarray(ds),
        jh.HistoryState.from_netcdf(tmp_path / "full.nc"),
    ):
        assert back.next_step == top + 1
        assert back.steps("loss").tolist() == [top]
        assert back.values("loss").tolist() == [1.0]
        with pytest.raises(ValueError, match="int64"):
            back.update({"loss": 2.0})
    ds.attrs["jaxhistory_next_step"] = top + 2  # past what a state can hold
    with pytest.raises(ValueError, match="not a whole number"):
        jh.HistoryState.from_xarray(ds)


def test_from_xarray_refuses_the_root_group_of_a_dataset_file(tmp_path):
    """Finding: HistoryState.from_xarray(xr.open_dataset("dataset.nc")) gave
    only the metrics stored at the file's top level (1 of the demo's 39),
    without a word."""
    import xarray as xr

    from jaxhistory.export import to_netcdf

    state = jh.HistoryState().update({"train/loss": 1.0, "lr": 0.1})
    to_netcdf(state, tmp_path / "dataset.nc")
    with (
        xr.open_dataset(tmp_path / "dataset.nc") as root,
        pytest.raises(ValueError, match=r"from_netcdf\(path\)"),
    ):
        jh.HistoryState.from_xarray(root)
    back = jh.HistoryState.from_netcdf(tmp_path / "dataset.nc")
    assert set(back.keys) == {"train/loss", "lr"}
    assert jh.HistoryState.from_xarray(state.to_xarray()).keys == state.keys
