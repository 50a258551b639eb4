"""The adapter's `state_dict` / `load_state_dict`: torch's layout (`torch_class` set) or
purestep's generic one, param names either way, complex params as torch keeps them."""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import Tensor

from . import _layout as L
from ._group import Group


def export(opt: Any) -> dict[str, Any]:
    """The adapter's `state_dict()`: torch's layout when `opt.torch_class` is set, else the generic one."""
    for index, (group, g) in enumerate(zip(opt.param_groups, opt._groups)):
        if g.lazy:
            g.materialize(group["params"], f"param group {index}")
    torch_layout = opt.torch_class is not None
    state: dict[int, dict[str, Tensor]] = {}
    groups = []
    first = 0
    for group, g in zip(opt.param_groups, opt._groups):
        ids = list(range(first, first + len(g.names)))
        first += len(g.names)
        packed = {k: v for k, v in group.items() if k != "params"}
        packed["params"] = ids
        if torch_layout:
            exported = L.export_torch(g.state, g.names, ids, cast(L.Mirror, g.mirror), group, g.torch_steps())
            for i, p in zip(ids, group["params"]):
                if p.is_complex() and i in exported:  # torch keeps a complex param's buffers complex
                    exported[i] = {k: v if k == "step" else torch.view_as_complex(v) for k, v in exported[i].items()}
            state.update(exported)
        else:
            g.sync()
            per, packed["shared_state"] = L.export_generic(g.state, g.names, ids)
            if len(g.cohorts) > 1:  # its params step apart: each one's own count
                for i, step in zip(ids, g.torch_steps()):
                    per.setdefault(i, {})["step"] = step
            state.update(per)
        for i, extra in zip(ids, opt._extras(group["params"], g)):
            if extra:
                state.setdefault(i, {}).update(extra)
        groups.append(packed)
    for key, value in opt.state.items():  # what code keyed by anything but a param (torch keeps it as is)
        if not isinstance(key, Tensor):
            state[key] = value
    return {"state": state, "param_groups": groups}


def load(opt: Any, state_dict: dict[str, Any]) -> None:
    """The adapter's `load_state_dict()`: everything checked before anything is applied."""
    if not isinstance(state_dict, dict) or "param_groups" not in state_dict or "state" not in state_dict:
        raise ValueError("state_dict must be a dict with 'state' and 'param_groups', as Optimizer.state_dict() gives")
    for index, (group, g) in enumerate(zip(opt.param_groups, opt._groups)):
        if g.lazy:
            g.materialize(group["params"], f"param group {index}")
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(opt.param_groups):
        raise ValueError(f"state_dict has {len(saved_groups)} param groups, this optimizer has {len(opt.param_groups)}")
    torch_layout = opt.torch_class is not None
    state_dict_entries = state_dict["state"]
    saved_state, extras = _split_extras(state_dict_entries, opt._groups, saved_groups, torch_layout)
    complex_ids = {
        i
        for sg, group in zip(saved_groups, opt.param_groups)
        for i, p in zip(sg["params"], group["params"])
        if p.is_complex()
    }
    saved_state = {
        i: {
            k: torch.view_as_real(v) if i in complex_ids and torch.is_tensor(v) and v.is_complex() else v
            for k, v in e.items()
        }
        for i, e in saved_state.items()
    }
    state_dict = {**state_dict, "state": saved_state}
    new_states, new_steps = [], []
    for index, (saved, g) in enumerate(zip(saved_groups, opt._groups)):
        where = f"param group {index}"
        ids = list(saved["params"])
        if len(ids) != len(g.names):
            raise ValueError(f"{where} of the state_dict has {len(ids)} params, this optimizer's has {len(g.names)}")
        if "param_names" in saved and _named(g.names) and list(saved["param_names"]) != g.names:
            diff = next(a for a, b in zip(saved["param_names"], g.names) if a != b)
            raise ValueError(f"{where}: the state_dict names a param {diff!r} this optimizer lacks")
        if torch_layout == ("shared_state" in saved):
            raise ValueError(L.layout_mismatch(opt.torch_class, where))
        if torch_layout:
            for key, value in g.static.items():
                if key in saved and not L.same(L.canonical(key, saved[key]), L.canonical(key, value)):
                    raise ValueError(
                        f"{where} of the state_dict has {key}={saved[key]!r}, this optimizer was built "
                        f"with {key}={value!r}; build it with the same {key}"
                    )
            new, steps = L.import_torch(g.state, g.names, ids, cast(L.Mirror, g.mirror), state_dict["state"], where)
        else:
            shared = saved["shared_state"]
            new = L.import_generic(g.state, g.names, ids, state_dict["state"], shared, where)
            own = [_step_of(state_dict["state"].get(i), f"{where}: state[{i}]") for i in ids]
            steps = [s for s in own if s is not None]
            if steps and len(steps) != len(own):
                raise ValueError(f"{where}: the state_dict gives some params a 'step' and not others")
        new_states.append(new)
        new_steps.append(steps)
    values = [
        {**group, **{k: v for k, v in saved.items() if k not in ("params", "param_names", "shared_state")}}
        for saved, group in zip(saved_groups, opt.param_groups)
    ]
    for index, (trial, g, new) in enumerate(zip(values, opt._groups, new_states)):
        opt._check_push(trial, g, new, index)  # every value checked before anything changes
    for index, (trial, group, g, new) in enumerate(zip(values, opt.param_groups, opt._groups, new_states)):
        g.state = new
        g.refresh()
        steps = new_steps[index]
        if g.cohortable and steps:  # each param its own count (params that stepped apart)
            g.set_steps([float(s) for s in steps])
        group.update({k: v for k, v in trial.items() if k not in ("params", "param_names")})
        saved = saved_groups[index]
        if (
            "param_names" in saved and "param_names" not in group
        ):  # a named state_dict names an unnamed group, as torch's
            group["param_names"] = list(saved["param_names"])
        opt._push(group, g, index)
        for p in group["params"]:  # what code put there before is replaced by what was saved
            dict.pop(opt.state, p, None)
        g.shown, g.live = {}, set()
        opt.state.mark_stale()
    for p, extra in zip((p for group in opt.param_groups for p in group["params"]), extras):
        if extra:
            opt.state[p].update(extra)
    # Entries keyed by anything but a param are replaced by the saved ones, as torch does.
    saved_ids = {i for saved in saved_groups for i in saved["params"]}
    for key in [k for k in dict.keys(opt.state) if not isinstance(k, Tensor)]:
        dict.pop(opt.state, key)
    for key, value in state_dict_entries.items():
        if key not in saved_ids:
            opt.state[key] = value


def _step_of(entry: dict | None, where: str) -> int | None:
    """A generic-layout entry's own `step` (a group whose params stepped apart), or None."""
    if not entry or "step" not in entry:
        return None
    try:
        return int(torch.as_tensor(entry["step"]).round())
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"{where}['step'] is not a number ({e})") from None


def _named(names: list[str]) -> bool:
    """Whether a group's names came from `named_parameters()` (not the positions given by default)."""
    return not all(n.isdigit() for n in names)


def _split_extras(saved: dict, groups: list[Group], saved_groups: list[dict], torch_layout: bool) -> tuple[dict, list]:
    """The saved per-param entries without what code other than the transform put there
    (a wrapper's keys), and those keys per param in order, to go back into `state`."""
    kept, extras = {}, []
    for g, sg in zip(groups, saved_groups):
        own: list[set[str]] = [set() for _ in g.names]
        for _, j, key in g.buffers:
            own[j].add(key)
        for j, i in enumerate(sg["params"]):
            entry = saved.get(i) or {}
            known = own[j] | ({"step"} | set(L.BUFFER_NAMES.values()) if torch_layout else set())
            known |= {"step"} if g.cohortable else set()
            kept_entry = {k: v for k, v in entry.items() if k in known}
            if kept_entry or i in saved:
                kept[i] = kept_entry
            extras.append({k: v for k, v in entry.items() if k not in known})
    return {i: e for i, e in kept.items() if e}, extras
