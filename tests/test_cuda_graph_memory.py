"""The memory a CUDA graph holds (numbafuse/cuda/__init__.py: ``_Block``, ``_Capture``), with fake
pool buffers (no GPU needed; on a GPU tests/cuda/test_graph_cuda.py runs real captures): a
block used by a graph never goes back to the pool while the graph lives, whatever becomes of
its arrays; a block freed during the capture serves a later request of that capture; closing
the graph gives back what no array views, the rest when its arrays die; a block two graphs
hold goes back after both are closed."""
import pytest

from numbafuse import cuda as nfcuda


class _Buffer:
    def __init__(self, address, log):
        self.handle, self.log = address, log

    def close(self, stream):
        self.log.append(self.handle)


class _Pool:
    def __init__(self):
        self.live, self.freed, self.stats, self.next = {}, [], nfcuda._Stats(), 0x1000

    def block(self, nbytes):
        buffer = _Buffer(self.next, self.freed)
        self.next += 0x1000
        block = nfcuda._Block(buffer, nbytes, None, self.stats, self)
        self.live[buffer.handle] = block
        capture = nfcuda._CAPTURE[0]
        if capture is not None:
            capture.hold(block)
        block.alive = True           # an array views it (the pool's _array)
        return block

    def take_back(self, block):      # the pool's: the block is free (here: recorded)
        del self.live[block.buffer.handle]
        self.freed.append(block.buffer.handle)


@pytest.fixture
def pool():
    yield _Pool()
    nfcuda._CAPTURE[0] = None


def _begin():
    capture = nfcuda._CAPTURE[0] = nfcuda._Capture(None)
    return capture


def _end(capture):
    nfcuda._CAPTURE[0] = None


def test_without_a_graph_a_dead_block_goes_back_to_the_pool(pool):
    a = pool.block(64)
    a.release()
    assert pool.freed == [a.buffer.handle] and a.buffer.handle not in pool.live


def test_a_block_a_graph_uses_stays_until_the_graph_is_closed(pool):
    before = pool.block(64)              # made before the capture, used by it (a parameter)
    capture = _begin()
    capture.hold(before)                 # what a captured launch does with its arguments
    during = pool.block(32)              # made during it, alive after it (an output)
    _end(capture)
    before.release()
    during.release()
    assert pool.freed == []              # the graph still reads and writes both
    capture.close()
    assert sorted(pool.freed) == sorted([before.buffer.handle, during.buffer.handle])


def test_a_block_freed_during_the_capture_serves_a_later_request_of_it(pool):
    old = pool.block(128)                # e.g. the previous step's activation
    capture = _begin()
    old.release()                        # dies during the capture: held, then reusable
    assert pool.freed == [] and capture.reuse(64) is None
    assert capture.reuse(128) is old
    assert capture.reuse(128) is None    # taken once
    _end(capture)
    capture.close()
    assert pool.freed == [old.buffer.handle]


def test_closing_leaves_a_viewed_block_to_its_arrays(pool):
    capture = _begin()
    out = pool.block(16)
    _end(capture)
    capture.close()
    assert pool.freed == []              # an array still views it
    out.release()
    assert pool.freed == [out.buffer.handle]


def test_a_block_two_graphs_hold_goes_back_after_both(pool):
    shared = pool.block(64)
    first = _begin()
    first.hold(shared)
    _end(first)
    second = _begin()
    second.hold(shared)
    shared.release()                     # dies during the second capture
    assert second.reuse(64) is None      # the first graph may still read it: not scratch
    _end(second)
    first.close()
    assert pool.freed == []
    second.close()
    assert pool.freed == [shared.buffer.handle]


def test_block_at_finds_the_block_of_an_address_inside_it(pool):
    a = pool.block(0x800)
    pool_before, nfcuda._pool = nfcuda._pool, None
    try:
        fake = nfcuda._CudaPool.__new__(nfcuda._CudaPool)
        fake.live = pool.live
        assert fake.block_at(a.buffer.handle) is a
        assert fake.block_at(a.buffer.handle + 0x7ff) is a
        assert fake.block_at(a.buffer.handle + 0x800) is None
    finally:
        nfcuda._pool = pool_before
