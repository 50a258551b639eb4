"""`purestep plan`: a run planned on torch's fake process group, here at 4096 ranks.

Each planned rank runs in a process of its own (spawned), so these tests pay a Python start
per rank; the demo's GPT keeps the rest to seconds.
"""

from __future__ import annotations

import json

import pytest

from purestep.api import cli
from purestep.api.config import apply_overrides
from purestep.api.errors import ConfigError
from purestep.api.planner import plan


def test_plan_of_the_demo_at_4096_ranks_reports_every_ranks_bytes_and_the_steps_collectives(capsys):
    code = cli._main(["plan", "demo", "--world", "4096", "--set", "strategy=fsdp", "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["world"] == 4096 and [r["rank"] for r in report["ranks"]] == [0, 4095]
    params = report["bytes"]["params"]
    # the 256-row embedding holds one row on ranks 0-255 and none on the others: every rank counted
    assert params["mean"] == pytest.approx(params["ideal"]) and params["max"] > params["mean"]
    assert report["bytes"]["grads"] == params
    for r in report["ranks"]:
        assert r["explain"].startswith("sharded"), r["explain"]
        # one all_reduce for the clip's norm, one for the non-finite check; Muon: an all_to_all each way
        assert r["collectives"]["all_reduce"]["calls"] == 2
        assert r["collectives"]["all_to_all_single"]["calls"] == 2
    work = report["owner_work"]
    assert work["what"].startswith("muon_adamw") and work["max"] >= work["largest_matrix"] > 0


def test_collectives_per_step_do_not_grow_with_the_number_of_layers():
    def calls(layers: int) -> dict:
        cfg = apply_overrides(cli.demo_config(), ["strategy=hsdp", "replicate=4", f"model.n_layer={layers}"])
        report = plan(cfg, 64, ranks=[5])
        return {k: v["calls"] for k, v in report["ranks"][0]["collectives"].items()}

    two, eight = calls(2), calls(8)
    assert two == eight and two["all_reduce"] >= 1, (two, eight)


def test_plan_refuses_what_it_cannot_plan_naming_the_field(capsys):
    with pytest.raises(ConfigError, match="strategy"):
        plan(cli.demo_config(), 8)  # "single" runs one rank
    with pytest.raises(ConfigError, match="ranks"):
        plan(apply_overrides(cli.demo_config(), ["strategy=fsdp"]), 8, ranks=[8])
    with pytest.raises(SystemExit) as exit:
        cli.main(["plan", "demo", "--world", "6", "--set", "strategy=hsdp", "--set", "replicate=4"])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert "replicate=4 does not divide" in err and "Traceback" not in err
