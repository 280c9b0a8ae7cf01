"""`jtile schedule`: peaks per policy, arena, gantt and PNG files, JSON."""

import json

import pytest

from jtile.cli import main


def test_cli_prints_every_policy_and_the_arena(capsys, tmp_path):
    mmd, png = tmp_path / "s.mmd", tmp_path / "s.png"
    assert main(["schedule", "tutorial", "--policy", "alap", "--mermaid", str(mmd), "--png", str(png)]) == 0
    out = capsys.readouterr().out
    for policy in ("program", "asap", "alap", "critical", "memory"):
        assert f"\n{policy} " in out
    assert "arena for 'alap' (greedy by size)" in out
    assert mmd.read_text().startswith("gantt\ndateFormat x\naxisFormat %Q\n\n")
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_cli_json_has_the_schedule_and_the_peaks(capsys):
    assert main(["schedule", "resnet18", "--size", "64", "--granularity", "op", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["granularity"] == "op" and out["policy"] == "memory"
    assert set(out["peaks"]) == {"program", "asap", "alap", "critical", "memory"}
    assert out["peaks"]["memory"]["peak_bytes"] <= out["peaks"]["program"]["peak_bytes"]
    assert out["arena_bytes"] >= out["peak_bytes"] == out["peaks"]["memory"]["peak_bytes"]
    assert [r["name"] for r in out["runs"]][0] == "args[0]"


def test_cli_rejects_unknown_models_and_policies(capsys):
    assert main(["schedule", "lenet"]) == 2
    assert "zoo models are" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["schedule", "tutorial", "--policy", "fast"])
