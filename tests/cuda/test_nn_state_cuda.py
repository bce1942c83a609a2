"""numbafuse.nn's PyTorch-named state on the device: ``Module.to("cuda")`` moves parameters and
running statistics but keeps ``num_batches_tracked`` (a host counter) on the host; training on
the device counts batches; ``state_dict`` comes back to the host and loads into a host model.

    NUMBA_ENABLE_CUDASIM=1 python -m pytest tests/cuda/test_nn_state_cuda.py -q
"""
import numpy as np
from numba import cuda

from numbafuse import backend, nn


def test_to_cuda_keeps_the_batch_counter_on_the_host_and_counts():
    rng = np.random.default_rng(0)
    m = nn.Sequential(nn.ConvBatchNormReLU(2, 3, 3, padding=1, dtype=np.float64),
                      nn.BatchNormAddReLU(3, dtype=np.float64)).to("cuda")
    conv_bn, bn = m[0].bn, m[1]
    assert backend.is_device_array(conv_bn.running_mean) and backend.is_device_array(bn.weight.data)
    assert isinstance(bn.num_batches_tracked, np.ndarray)
    x = cuda.to_device(rng.standard_normal((2, 2, 4, 4)))
    for _ in range(2):
        h = m[0](x)
        m[1](h, h)
    assert int(conv_bn.num_batches_tracked) == int(bn.num_batches_tracked) == 2
    state = m.state_dict()
    assert all(isinstance(v, np.ndarray) for v in state.values())
    assert state["1.num_batches_tracked"].dtype == np.int64
    host = nn.Sequential(nn.ConvBatchNormReLU(2, 3, 3, padding=1, dtype=np.float64),
                         nn.BatchNormAddReLU(3, dtype=np.float64)).load_state_dict(state)
    np.testing.assert_array_equal(host[1].running_var, state["1.running_var"])
    assert int(host[0].bn.num_batches_tracked) == 2
