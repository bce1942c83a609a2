"""On a GPU: every op gives the same bits through the prepared launch as through numba's own
(``kernels/cuda/launch.py``; ``tests/test_cuda_launch.py`` checks the argument layout
itself without a GPU). Under the simulator both are numba's launch: nothing to compare."""
import os

import numpy as np
import pytest

import numbafuse as nf
from numbafuse import cuda as nfcuda, models, optim
from numbafuse.kernels.cuda import config
from numbafuse.train import train_step

pytestmark = pytest.mark.skipif(os.environ.get("NUMBA_ENABLE_CUDASIM", "0") == "1",
                                reason="the simulator has only numba's launch")


def _run(launch, monkeypatch, layout):
    monkeypatch.setattr(config, "launch", launch)
    rng = np.random.default_rng(0)
    shape = (3, 10, 9, 7) if layout == "NCHW" else (3, 9, 7, 10)
    dev = lambda a: nfcuda.to_device(np.ascontiguousarray(a, np.float32))  # noqa: E731
    x, z, gy = (dev(rng.standard_normal(shape)) for _ in range(3))
    w, b = dev(rng.standard_normal((10, 10, 3, 3)) / 9), dev(rng.standard_normal(10))
    gam, bet = dev(rng.uniform(0.5, 1.5, 10)), dev(rng.standard_normal(10))
    rm, rv = dev(np.zeros(10)), dev(np.ones(10))
    out = []
    for stride in (1, 2):
        y = nf.conv_bias_relu(x, w, b, stride=stride, padding=1, layout=layout)
        g = nf.conv_bias_relu_backward(dev(rng.standard_normal(y.shape)), x, w, y,
                                       stride=stride, padding=1, layout=layout)
        out += [y, *g]
    y = nf.batchnorm_add_relu(x, z, gam, bet, running_mean=rm, running_var=rv, layout=layout)
    out += [y, rm, rv, *nf.batchnorm_add_relu_backward(gy, x, z, gam, bet, y=y, layout=layout)]
    model = models.make_model("fused", layout=layout).to("cuda")
    opt = optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    xb = dev(rng.standard_normal((8, 8, 8, 1) if layout == "NHWC" else (8, 1, 8, 8)))
    yb = nfcuda.to_device(rng.integers(0, 10, 8))
    for _ in range(2):
        out.append(train_step(model, opt, xb, yb)[0].data)
    out += [p.data for p in model.parameters()]
    return [a.copy_to_host() for a in out]


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_prepared_launches_give_numbas_bits(layout, monkeypatch):
    numba = _run("numba", monkeypatch, layout)
    prepared = _run("prepared", monkeypatch, layout)
    assert len(numba) == len(prepared)
    for i, (a, b) in enumerate(zip(numba, prepared)):
        assert a.shape == b.shape and a.tobytes() == b.tobytes(), f"output {i} differs"
