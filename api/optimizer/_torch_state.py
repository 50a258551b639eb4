"""torch.optim's `state` dict (param -> entry) shown over the adapter's transform states."""

from __future__ import annotations

import collections
from typing import Any, Callable

from torch import Tensor


class Entry(dict):
    """One param's entry of `TorchState`: a dict that tells its state when code writes to it."""

    def __init__(self, owner: "TorchState", key: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._owner, self._key = owner, key

    def _wrote(self) -> None:
        self._owner.wrote(self._key)

    def __setitem__(self, k: Any, v: Any) -> None:
        super().__setitem__(k, v)
        self._wrote()

    def __delitem__(self, k: Any) -> None:
        super().__delitem__(k)
        self._wrote()

    def pop(self, *args: Any) -> Any:
        self._wrote()
        return super().pop(*args)

    def popitem(self) -> Any:
        self._wrote()
        return super().popitem()

    def clear(self) -> None:
        super().clear()
        self._wrote()

    def update(self, *args: Any, **kwargs: Any) -> None:
        super().update(*args, **kwargs)
        self._wrote()

    def setdefault(self, k: Any, default: Any = None) -> Any:
        self._wrote()
        return super().setdefault(k, default)

    def __ior__(self, other: Any) -> "Entry":  # type: ignore[misc]  # `entry |= {...}` writes too
        self.update(other)
        return self

    def __reduce__(self) -> Any:  # pickled, copied and saved as the plain dict it stands for
        return (dict, (dict(self),))


def _plain(items: list) -> collections.defaultdict:
    return collections.defaultdict(dict, items)


class TorchState(collections.defaultdict):
    """torch.optim's `state` (param -> dict): the params' purestep buffers are filled in when
    it is read, so a step only marks it stale and costs nothing here. Reading costs nothing
    at the next step either: an entry this state makes is an `Entry`, which tells the state
    when code writes to it, and the next step takes in what code changed (`Group.take_edits`)
    for the params written to alone (`touched`), or for every param after a write that may
    reach them all (`edited`: `clear()`). A dict code puts in (`state[p] = d`, a new `state`)
    stays that very dict, as in torch; its param is checked at every step (`untracked`).
    Reading one param's entry (`state[p]`, `state.get(p)`, `p in state`) shows that entry
    alone. Copied or pickled, it is a plain `defaultdict(dict)` of plain dicts."""

    def __init__(
        self,
        refresh: Callable[[set[int], bool], None],
        refresh_one: Callable[[Tensor, bool], bool] | None = None,
    ) -> None:
        super().__init__(dict)
        self._refresh, self._refresh_one = refresh, refresh_one
        self.stale, self.edited = True, False
        self.steps_only = False  # stale since a step alone: the entries' buffers are the live ones still
        self.shown_now: set[int] = set()  # ids of the params shown since the state went stale
        self.touched: dict[int, Any] = {}  # keys written to since the last step
        self.untracked: dict[int, Any] = {}  # keys whose entry is a dict code put in (not an Entry)

    def entry(self, key: Any) -> dict:
        """`key`'s entry, made (an empty `Entry`) when it has none."""
        got = dict.get(self, key)
        if not isinstance(got, dict):
            got = Entry(self, key)
            dict.__setitem__(self, key, got)
        return got

    def wrote(self, key: Any) -> None:
        self.touched[id(key)] = key

    def _held(self, key: Any, value: Any) -> None:
        """Note whether `key`'s new entry reports writes (an `Entry`) or is code's own dict."""
        if isinstance(value, dict) and not isinstance(value, Entry):
            self.untracked[id(key)] = key
        else:
            self.untracked.pop(id(key), None)

    def __reduce__(self) -> Any:
        self.fresh()
        return (_plain, ([(k, dict(v) if isinstance(v, dict) else v) for k, v in dict.items(self)],))

    def __copy__(self) -> collections.defaultdict:  # type: ignore[override]  # a plain one, as __reduce__ gives
        return _plain([(k, v) for k, v in dict.items(self.fresh())])

    def mark_stale(self, steps_only: bool = False) -> None:
        """The buffers moved on (a step, a load): every entry is shown anew when next read
        (after a step alone, `steps_only`: its steps; its buffers are the same tensors)."""
        self.steps_only = steps_only and (self.steps_only or not self.stale)
        self.stale, self.shown_now = True, set()

    def fresh(self) -> "TorchState":
        if self.stale:
            self.stale = False
            self._refresh(self.shown_now, self.steps_only)  # entries shown one by one keep what code did to them
        return self

    def _one(self, key: Any) -> bool:
        """Show `key`'s entry alone (a param this state knows); False for anything else."""
        if self._refresh_one is None or not isinstance(key, Tensor):
            return False
        if self.stale and id(key) not in self.shown_now:
            if not self._refresh_one(key, self.steps_only):
                return False
            self.shown_now.add(id(key))
        return True

    def __missing__(self, key: Any) -> Any:  # as defaultdict(dict), the new entry an `Entry`
        return self.entry(key)

    # Writes show the buffers first, so that the next step sees what was there before them.
    def __setitem__(self, key: Any, value: Any) -> None:
        super(TorchState, self.fresh()).__setitem__(key, value)
        self._held(key, value)
        self.wrote(key)

    def __delitem__(self, key: Any) -> None:
        super(TorchState, self.fresh()).__delitem__(key)
        self.untracked.pop(id(key), None)
        self.wrote(key)

    def pop(self, key: Any, *default: Any) -> Any:
        self.wrote(key)
        self.untracked.pop(id(key), None)
        return super(TorchState, self.fresh()).pop(key, *default)

    def popitem(self) -> Any:
        key, value = super(TorchState, self.fresh()).popitem()
        self.untracked.pop(id(key), None)
        self.wrote(key)
        return key, value

    def setdefault(self, key: Any, default: Any = None) -> Any:
        if not dict.__contains__(self.fresh(), key):
            self[key] = default
        return dict.__getitem__(self, key)

    def update(self, *args: Any, **kwargs: Any) -> None:
        for key, value in dict(*args, **kwargs).items():
            self[key] = value

    def clear(self) -> None:
        super(TorchState, self.fresh()).clear()
        self.untracked.clear()
        self.edited = True

    def __getitem__(self, key: Any) -> Any:
        if self._one(key):
            return super().__getitem__(key)  # a param without an entry gets an empty one, as torch's
        return super(TorchState, self.fresh()).__getitem__(key)

    def __iter__(self) -> Any:
        return super(TorchState, self.fresh()).__iter__()

    def __len__(self) -> int:
        return super(TorchState, self.fresh()).__len__()

    def __contains__(self, key: Any) -> bool:
        if self._one(key):
            return super().__contains__(key)
        return super(TorchState, self.fresh()).__contains__(key)

    def __repr__(self) -> str:
        return dict.__repr__(self.fresh())

    def get(self, key: Any, default: Any = None) -> Any:
        if self._one(key):
            return super().get(key, default)
        return super(TorchState, self.fresh()).get(key, default)

    def items(self) -> Any:
        return super(TorchState, self.fresh()).items()

    def keys(self) -> Any:
        return super(TorchState, self.fresh()).keys()

    def values(self) -> Any:
        return super(TorchState, self.fresh()).values()
