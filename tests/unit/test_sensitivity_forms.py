"""sensitivity.dequantized_forms: the forms of every width, their scales as quantize_weights rounds them
(scale_mantissa_bits at the widths asked) and their rates with the scales' packed bytes (scale_bytes)."""

import numpy as np
import pytest

from modelgen import conv_model
from passes import graph
from passes import sensitivity as sens


def _scales(q):
    return {t.name[: -len("_scale")]: graph.tensor_to_array(t) for t in q.graph.initializer if t.name.endswith("_scale")}


def test_scales_rounded_only_at_the_widths_asked():
    m = conv_model()
    infos, models = sens.dequantized_forms(m, [4, 8], min_elements=16, scale_mantissa_bits=8, scale_mantissa_widths=(4,))
    assert set(infos) == {"W", "W2"}
    low = {b: np.concatenate([s.astype(np.float32).ravel().view(np.uint32) & 0xFFFF for s in _scales(q).values()])
           for b, q in models.items()}
    assert not low[4].any()  # bfloat16 values: the pack stores them in two bytes
    assert low[8].any()  # full float32 scales at the width not asked
    # the forms are those of the stored scales: the dequantized weight is levels x the rounded scale
    q4 = graph.unique_initializers(models[4])
    for name, info in infos.items():
        levels = graph.tensor_to_array(q4[name + "_quantized"]).astype(np.float32)
        scale = graph.tensor_to_array(q4[name + "_scale"])
        axis = levels.shape.index(scale.size)  # Conv W: axis 0 (16 channels); ConvTranspose W2: axis 1 (4)
        shape = [1] * levels.ndim
        shape[axis] = scale.size
        np.testing.assert_array_equal(info.options[4].dequantized, levels * scale.reshape(shape))


def test_rates_count_the_scales_as_scale_bytes_says():
    m = conv_model()
    raw, _ = sens.dequantized_forms(m, [4], min_elements=16)
    seen = []

    def scale_bytes(scale):
        seen.append(scale.shape)
        return 3.0

    packed, _ = sens.dequantized_forms(m, [4], min_elements=16, scale_bytes=scale_bytes)
    assert sorted(seen) == [(4,), (16,)]  # one scale per output channel: W (Conv) and W2 (ConvTranspose)
    for name in raw:
        r, p = raw[name].options[4], packed[name].options[4]
        assert p.levels_entropy_bytes == r.levels_entropy_bytes
        n_scales = {"W": 16, "W2": 4}[name]
        assert r.rate_bytes - r.levels_entropy_bytes == pytest.approx(4 * n_scales)  # float32 scales, raw
        assert p.rate_bytes - p.levels_entropy_bytes == pytest.approx(3.0)
