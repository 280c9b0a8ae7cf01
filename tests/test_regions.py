import hypothesis.strategies as st
import numpy as np
from hypothesis import given

from jtile._regions import SlidingWindow, Window, split


@given(st.integers(1, 50), st.integers(1, 50))
def test_split_covers_extent_with_near_equal_tiles(extent, tiles):
    windows = split(extent, min(tiles, extent))
    assert windows[0].start == 0 and windows[-1].stop == extent
    assert all(a.stop == b.start for a, b in zip(windows, windows[1:]))
    assert max(w.size for w in windows) - min(w.size for w in windows) <= 1


@given(
    size=st.integers(1, 30), window=st.integers(1, 4), stride=st.integers(1, 3),
    pad_lo=st.integers(0, 3), pad_hi=st.integers(0, 3), dilation=st.integers(1, 2),
    data=st.data(),
)
def test_input_region_reproduces_padded_window(size, window, stride, pad_lo, pad_hi, dilation, data):
    sw = SlidingWindow(size, window, stride, pad_lo, pad_hi, dilation)
    if sw.out_size < 1:
        return
    start = data.draw(st.integers(0, sw.out_size - 1))
    out = Window(start, data.draw(st.integers(start + 1, sw.out_size)))
    region, (lo, hi) = sw.input_region(out)
    rows = np.arange(size, dtype=float)
    padded = np.concatenate([np.full(pad_lo, -1.0), rows, np.full(pad_hi, -1.0)])
    tile = np.concatenate([np.full(lo, -1.0), rows[region.start : region.stop], np.full(hi, -1.0)])
    # Every output row of the tile sees exactly the taps it sees in the full padded input.
    for i in range(out.size):
        full = padded[(out.start + i) * stride + np.arange(window) * dilation]
        local = tile[i * stride + np.arange(window) * dilation]
        assert np.array_equal(full, local)
    assert lo >= 0 and hi >= 0 and lo <= pad_lo and hi <= pad_hi
