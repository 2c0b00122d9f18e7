"""The gradient buckets' buffer: a bucket whose download is still queued is reused only with the
compute stream ordered after that download, never by the host waiting for it."""
import pytest
import torch

from infinity.errors import EngineError
from infinity.runtime.datapath import DONE
from infinity.runtime.reduce_buckets import ReduceBuckets


class Download:
    """A queued download: done once ``finished``; a host wait on it is a test failure."""

    def __init__(self) -> None:
        self.finished = False

    def query(self) -> bool:
        return self.finished

    def synchronize(self) -> None:
        raise AssertionError("the host waited for a download")


class Stream:
    """The data path as the buckets see it: records what the compute stream was ordered after."""

    def __init__(self) -> None:
        self.after: list = []

    def use(self, event) -> None:
        self.after.append(event)

    def settle(self, wait: bool = False) -> None:
        raise AssertionError("the buckets asked the data path to wait")


def _buckets(capacity_buckets: int = 2, nbytes: int = 4096) -> tuple[ReduceBuckets, Stream]:
    stream = Stream()
    buckets = ReduceBuckets(torch.device("cpu"), stream, capacity_buckets * nbytes)
    buckets.size_for(nbytes, "block")
    return buckets, stream


def test_a_done_download_gives_its_bucket_back_at_once():
    buckets, stream = _buckets()
    for _ in range(5):
        loan = buckets.take(4096, "g")
        buckets.release_after(loan, DONE)
    assert buckets.arena.bytes_in_use == 0 and buckets.waits == 0 and stream.after == []


def test_a_full_buffer_reuses_the_oldest_cooling_bucket_after_its_download_on_the_device():
    buckets, stream = _buckets()
    first, second = Download(), Download()
    a = buckets.take(4096, "a")
    buckets.release_after(a, first)
    b = buckets.take(4096, "b")         # the other half: the first may still be downloading
    assert b.tensor.data_ptr() != a.tensor.data_ptr()
    buckets.release_after(b, second)
    c = buckets.take(4096, "c")         # full: the first's memory, the compute stream after its download
    assert stream.after == [first] and buckets.waits == 1
    buckets.release_after(c, Download())
    second.finished = True
    buckets.take(4096, "d")             # the second's download was seen done: no ordering needed
    assert stream.after == [first] and buckets.waits == 1


def test_a_bucket_never_given_back_is_an_error_naming_the_key():
    buckets, _ = _buckets(capacity_buckets=1)
    buckets.take(4096, "gradients block.0")
    with pytest.raises(EngineError, match="partition.reduce_bucket_bytes: gradients block.1 needs 4096 bytes"):
        buckets.take(4096, "gradients block.1")
