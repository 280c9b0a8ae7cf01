import contextlib
import io
import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def _python_blocks() -> list[str]:
    """The ```python blocks; ```py blocks are shown, not run (the multi-host
    recipe needs several processes: tests/test_sharding.py runs that one)."""
    return re.findall(r"^```python\n(.*?)^```$", README.read_text(), re.M | re.S)


def test_readme_python_blocks_run_in_order():
    blocks = _python_blocks()
    assert len(blocks) >= 3, "the README tour lost its code blocks"
    namespace = {"__name__": "readme"}
    out = io.StringIO()
    for i, block in enumerate(blocks):
        with contextlib.redirect_stdout(out):
            exec(compile(block, f"README.md python block {i + 1}", "exec"), namespace)
    printed = out.getvalue()
    assert "concatenate" in printed and printed.count("conv_general_dilated") == 2
    assert re.search(r"speed-up over jax.jit\(fn\): tiled \d+\.\d+x, fast \d+\.\d+x", printed)
    assert "Total params: 1,024" in printed


def test_readme_quick_start_is_exactly_two_commands():
    quick = README.read_text().split("## Quick start", 1)[1]
    commands = re.search(r"```bash\n(.*?)```", quick, re.S).group(1).strip().splitlines()
    assert commands == ["pip install . && jtile demo", "pip install '.[test]' && pytest"]
