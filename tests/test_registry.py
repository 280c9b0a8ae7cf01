import pytest

import jtile  # noqa: F401  (registers every entry)
from jtile import _registry


def test_facet_table(capsys):
    """Which ops have which facets: printed with `pytest -s`, and the core ops pinned."""
    table = _registry.entries()
    with capsys.disabled():
        width = max(len(n) for n in table)
        print()
        for name, entry in sorted(table.items()):
            print(f"{name:<{width}}  {' '.join(entry.facets())}")
    conv = table["conv_general_dilated"].facets()
    assert {"macs", "describe", "onnx", "weights", "activations"} <= set(conv)
    assert {"macs", "describe", "onnx"} <= set(table["conv_bias_act"].facets())
    assert "macs" in table["ffi_call:jtile_conv_smm"].facets()
    assert all(e.facets() for e in table.values())


def test_a_facet_is_registered_once():
    with pytest.raises(ValueError, match="already has a 'macs' facet"):
        _registry.register("conv_general_dilated", macs=lambda eqn: None)
    with pytest.raises(TypeError, match="unknown facet"):
        _registry.register("conv_general_dilated", colour="red")
