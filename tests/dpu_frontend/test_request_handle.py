"""RequestHandle's hand-over rules: tokens go to the sink only while the consumer is parked with
nothing buffered and the batch is not the last; everything else is buffered, in order."""
from __future__ import annotations

import asyncio

from dpu_frontend.request_handle import RequestHandle


def make_handle(cancels: list | None = None) -> RequestHandle:
    def on_cancel(h, reason, error):
        if cancels is not None:
            cancels.append((reason, error))
        h._end(reason, error)
    return RequestHandle(seq=1, slot=0, prompt_tokens=3, max_tokens=100, t_submit_ns=0, max_buffered_tokens=50,
                         on_cancel=on_cancel)


def start_consumer(h: RequestHandle) -> tuple[list, asyncio.Future]:
    """A task iterating the handle as a request's handler does; `got` collects its batches."""
    got = []

    async def consume():
        async for batch in h:
            got.append(batch)
    return got, asyncio.ensure_future(consume())


async def test_sink_takes_batches_only_while_the_consumer_is_parked():
    h = make_handle()
    sunk = []
    h.sink = lambda tokens: sunk.append(list(tokens)) or True
    h._deliver([1])                        # nobody parked yet: buffered
    assert sunk == [] and h._pending == [1]
    got, task = start_consumer(h)
    await asyncio.sleep(0)
    assert got == [[1]]                    # the buffered batch first, then the consumer parks
    h._deliver([2, 3])
    assert sunk == [[2, 3]] and h._pending == [] and h.completion_tokens == 3
    h._deliver([4], final=True)            # the last batch goes to the consumer with the end
    h._end("length")
    await task
    assert got == [[1], [4]] and sunk == [[2, 3]] and h.completion_tokens == 4


async def test_declined_or_woken_batches_stay_in_order():
    h = make_handle()
    accept = [False]
    sunk = []
    h.sink = lambda tokens: accept[0] and (sunk.append(list(tokens)) or True)
    got, task = start_consumer(h)
    await asyncio.sleep(0)
    h._deliver([1])                        # declined: buffered, the consumer is woken
    accept[0] = True
    h._deliver([2])                        # the consumer is woken but has not run: must not overtake [1]
    assert sunk == [] and h._pending == [1, 2]
    await asyncio.sleep(0)
    assert got == [[1, 2]]
    h._deliver([3])                        # parked again, nothing buffered: the sink
    assert sunk == [[3]]
    h._end("length")
    await task
    assert got == [[1, 2]]
