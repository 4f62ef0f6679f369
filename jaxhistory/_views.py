"""The read-only views of a recorded run that code written for ezpz reads:
``History.history`` (a dict of arrays), ``History.data`` (:class:`MetricsView`)
and ``History.groups`` (:class:`GroupsView`)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, NoReturn

import numpy as np

from jaxhistory._history_state import HistoryState
from jaxhistory._names import aggregated_names

__all__ = ["GroupsView", "MetricsView", "RunViews", "read_only"]


class MetricsView(Mapping):
    """A read-only ``{name: values}`` mapping over one
    :class:`~jaxhistory.HistoryState`: ``History.data`` and each group of
    ``History.groups``.

    Names come in the order first recorded; each value is the metric's values,
    one per record (a read-only NumPy array, read when asked for: only that
    metric waits for its device values). :attr:`state` is the state it views,
    for the steps (``view.state.steps(view.name(key))``). Later updates do not
    change a view: read ``History.data`` again for them.

    Examples:
        >>> import jaxhistory as jh
        >>> h = jh.History(distributed_history=False)
        >>> _ = h.update({"train": {"loss": 0.5}, "lr": 0.1}, step=0)
        >>> list(h.data), h.data["train/loss"].tolist()
        (['train/loss', 'lr'], [0.5])
    """

    __slots__ = ("_names", "_state", "_what")

    def __init__(
        self,
        state: HistoryState,
        names: Mapping[str, str] | None = None,
        what: str = "History.data",
    ):
        self._state = state
        self._names = dict(names) if names is not None else {k: k for k in state.keys}
        self._what = what

    @property
    def state(self) -> HistoryState:
        """The state this view reads."""
        return self._state

    def name(self, key: str) -> str:
        """The full metric name of ``key`` (``"loss"`` in the group ``train``:
        ``"train/loss"``)."""
        return self._names[key]

    def __getitem__(self, key: str) -> np.ndarray:
        return self._state.values(self._names[key])

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, key: object) -> bool:
        return key in self._names

    def __setitem__(self, key: str, value: Any) -> NoReturn:
        read_only(self._what)

    def __delitem__(self, key: str) -> NoReturn:
        read_only(self._what)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({list(self._names)!r})"


class GroupsView(Mapping):
    """``History.groups``: the metrics by group, ``{group: MetricsView}``, as
    ezpz's ``History.groups`` holds them.

    A metric's group is the first part of its name (``train/loss`` is ``loss``
    in the group ``train``); a name without ``/`` (or one starting with it) is
    in the group ``""`` under its whole name. Cross-device statistics stay with
    their metric: ``loss/mean`` of a metric ``loss`` is ``loss/mean`` in the
    group ``""``, and ``train/loss/mean`` is ``loss/mean`` in ``train``. Groups
    come in the order first recorded.

    Examples:
        >>> import jaxhistory as jh
        >>> h = jh.History(distributed_history=False)
        >>> _ = h.update({"train": {"loss": 0.5}, "eval/acc": 0.9, "lr": 0.1}, step=0)
        >>> {group: list(view) for group, view in h.groups.items()}
        {'train': ['loss'], 'eval': ['acc'], '': ['lr']}
    """

    __slots__ = ("_groups", "_state")

    def __init__(self, state: HistoryState):
        self._state = state
        groups: dict[str, dict[str, str]] = {}
        family = aggregated_names(state.keys)
        for name in state.keys:
            base = name.rpartition("/")[0] if name in family else name
            head, slash, _ = base.partition("/")
            group = head if slash and head else ""
            key = name[len(group) + 1 :] if group else name
            groups.setdefault(group, {})[key] = name
        self._groups = groups

    @property
    def state(self) -> HistoryState:
        """The state this view reads."""
        return self._state

    def __getitem__(self, group: str) -> MetricsView:
        return MetricsView(
            self._state, self._groups[group], f"History.groups[{group!r}]"
        )

    def __iter__(self) -> Iterator[str]:
        return iter(self._groups)

    def __len__(self) -> int:
        return len(self._groups)

    def __contains__(self, group: object) -> bool:
        return group in self._groups

    def __setitem__(self, key: str, value: Any) -> NoReturn:
        read_only("History.groups")

    def __delitem__(self, key: str) -> NoReturn:
        read_only("History.groups")

    def __repr__(self) -> str:
        groups = {g: list(names) for g, names in self._groups.items()}
        return f"{type(self).__name__}({groups!r})"


def read_only(what: str) -> NoReturn:
    raise TypeError(
        f"{what} is a read-only view of the recorded history: record with "
        "History.update (or set History.state to a HistoryState)"
    )


class RunViews:
    """History's views of what it recorded, as ezpz names them: each reads the
    ``state`` of the class it is mixed into when asked for."""

    state: HistoryState

    @property
    def history(self) -> dict[str, np.ndarray]:
        """Every metric's values so far, by name (read-only NumPy arrays, one
        value per record; the steps are ``history.state.steps(name)``): the dict
        view of the run, as ezpz's ``History.history``. Waits for device values."""
        state = self.state
        return {name: state.values(name) for name in state.keys}

    @property
    def data(self) -> MetricsView:
        """Every metric's values so far, by full name, as a read-only mapping
        (:class:`MetricsView`; ezpz's ``History.data``, an alias of its
        ``history``): the same names and arrays as :attr:`history`, each read
        when asked for (only that metric waits for its device values). A view
        of the state when read; read it again for later updates."""
        return MetricsView(self.state)

    @data.setter
    def data(self, value: Any) -> NoReturn:
        read_only("History.data")

    @property
    def groups(self) -> GroupsView:
        """The metrics by group, ``{group: {name: values}}`` (read-only,
        :class:`GroupsView`; ezpz's ``History.groups``): ``train/loss`` is
        ``groups["train"]["loss"]``, a name without ``/`` is in the group
        ``""``, and cross-device statistics stay with their metric
        (``groups[""]["loss/mean"]``, ``groups["train"]["loss/mean"]``)."""
        return GroupsView(self.state)

    @groups.setter
    def groups(self, value: Any) -> NoReturn:
        read_only("History.groups")
