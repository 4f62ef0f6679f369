"""The jaxhistory command (jaxhistory.cli)."""

import pytest

import jaxhistory as jh
from jaxhistory import export

# ----- report: max plots ------------------------------------------------------------


def test_cli_report_takes_max_plots(tmp_path):
    from jaxhistory import cli

    s = jh.HistoryState()
    for step in range(2):
        s = s.update({f"m{i}": float(step) for i in range(4)}, step=step)
    export.to_netcdf(s, tmp_path / "dataset.nc")
    out = tmp_path / "out"

    def report(cap):
        args = ["report", str(tmp_path / "dataset.nc"), "-o", str(out)]
        return cli.main([*args, "--max-plots", cap])

    assert report("1") == 0
    assert [p.name for p in (out / "plots" / "mplot").iterdir()] == ["m0.png"]
    assert report("all") == 0
    assert len(list((out / "plots" / "mplot").iterdir())) == 4
    with pytest.raises(SystemExit):
        report("many")
