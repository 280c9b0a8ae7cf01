import jtile
from jtile.cli import main
from jtile.commands import demo


def test_demo_reproduces_the_tutorial(capsys):
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "tutorial on input (4, 3, 66, 66), tile_conv(axis='H', tiles=4)" in out
    changed = ("conv_general_dilated", "slice", "concatenate")
    rows = {line.split()[0]: line.split()[1:3] for line in out.splitlines() if line.split()[:1] in [[c] for c in changed]}
    assert rows == {"concatenate": ["0", "1"], "conv_general_dilated": ["1", "4"], "slice": ["0", "4"]}
    assert "bit-identical: yes" in out and out.rstrip().endswith("atol=1e-06 x output scale)")


def test_demo_on_a_zoo_model_with_options(capsys):
    assert main(["demo", "--model", "resnet18", "--size", "64", "--batch", "2", "--tiles", "2", "--axis", "3"]) == 0
    out = capsys.readouterr().out
    assert "resnet18 on input (2, 3, 64, 64)" in out and "OK: tiled outputs match" in out


def test_demo_reports_too_many_tiles(capsys):
    assert main(["demo", "--tiles", "100"]) == 2
    captured = capsys.readouterr()
    assert "cannot make 100 tiles; use tiles <= 64" in captured.err
    assert "tiling, compiling and running ... failed" in captured.out


def test_demo_fails_when_tiled_outputs_differ(capsys, monkeypatch):
    def wrong_tiling(fn, **config):
        tiled = jtile.tile_conv(fn, **config)
        return lambda *args: tiled(*args) * 1.001

    monkeypatch.setattr(demo, "tile_conv", wrong_tiling)
    assert main(["demo"]) == 1
    assert "FAIL: tiled outputs differ" in capsys.readouterr().err
