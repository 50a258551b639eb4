"""Invariant family "flat_buffers": every registry transform, run on the packed buffers that
`make_update(compile=True, donate=True)` lays out (groups by per-leaf rules, stacks of
same-shape leaves for per-leaf math), gives the updates and states of its per-leaf run,
step after step, over hypothesis-drawn float64 trees of several leaves. This checks the
declared needs (the planner reads only those) and the packed semantics of every transform,
without compiling.
"""

from __future__ import annotations

import pytest
import torch
import torch.utils._pytree as pytree
from hypothesis import given, settings
from hypothesis import strategies as st

import purestep.core as ps
from purestep.core.engine import needs
from purestep.core.engine import packed as _flat
from purestep.core.testing import TOLERANCES, grad_trees, param_trees
from tests.registry import TRANSFORMS

# State that is not shaped like the params (a zero-size buffer per float64 param) is laid
# out per leaf: planning says so instead of packing.
PER_LEAF = {"compensated_updates", "soap", "scale_by_soap", "kron", "scale_by_kron"}  # SOAP, Kron: d × d factors per dimension
RTOL, ATOL = TOLERANCES[torch.float64]


def _unpack(tree):
    return pytree.tree_map(lambda x: x.unpack() if _flat.is_packed(x) else x, tree, is_leaf=_flat.is_packed)


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
@settings(max_examples=10, deadline=None)
@given(data=st.data())
def test_packed_buffers_give_the_per_leaf_results(name, data):
    case = TRANSFORMS[name]
    params = data.draw(param_trees(min_leaves=2, max_leaves=6, min_rank=2 if case.matrices_only else 0,
                                   dtypes=(torch.float64,)), label="params")
    opt = case.make()
    if name in PER_LEAF:
        with pytest.raises(_flat.NotPacked):
            needs.plan(opt, params)
        return
    spec = needs.plan(opt, params)
    shell = _flat.Packed(spec, [])
    pack = lambda tree: _flat.pack_like(shell, tree)  # noqa: E731
    state, packed_state = opt.init(params), opt.init(pack(params))
    for step in range(3):
        grads = data.draw(grad_trees(params, kinds=("normal", "mixed")), label=f"grads {step}")
        extra = {k: ps.tree_map(torch.abs, data.draw(grad_trees(params, kinds=("normal",)))) for k in case.extra_trees}
        args = (params,) if case.needs_params else ()
        packed_args = (pack(params),) if case.needs_params else ()
        updates, state = opt.update(grads, state, *args, **extra)
        packed_updates, packed_state = opt.update(pack(grads), packed_state, *packed_args,
                                                  **{k: pack(v) for k, v in extra.items()})
        got = pytree.tree_leaves(_unpack((packed_updates, packed_state)))
        want = pytree.tree_leaves((updates, state))
        assert len(got) == len(want), f"step {step}: {len(got)} leaves packed, {len(want)} per leaf"
        for i, (a, b) in enumerate(zip(got, want)):
            if isinstance(b, torch.Tensor):
                torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}, step {step}, leaf {i}: {m}")
            else:
                assert a == b, (name, step, i)
        if case.needs_params:
            params = ps.apply_updates(params, updates)
