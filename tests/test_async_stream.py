import asyncio
import threading

import pytest

from kvboost_rag.integration.async_stream import iterate_in_thread


def test_items_arrive_in_order_from_one_worker_thread():
    threads = set()

    def numbers():
        for i in range(5):
            threads.add(threading.get_ident())
            yield i

    async def collect():
        return [i async for i in iterate_in_thread(numbers)]

    assert asyncio.run(collect()) == [0, 1, 2, 3, 4]
    assert len(threads) == 1 and threading.get_ident() not in threads


def test_errors_reach_the_consumer():
    def failing():
        yield 1
        raise ValueError("boom")

    async def collect():
        return [i async for i in iterate_in_thread(failing)]

    with pytest.raises(ValueError, match="boom"):
        asyncio.run(collect())


def test_stopping_early_closes_the_iterator():
    closed = threading.Event()

    def endless():
        try:
            i = 0
            while True:
                yield i
                i += 1
        finally:
            closed.set()

    async def take_two():
        out = []
        stream = iterate_in_thread(endless)
        async for i in stream:
            out.append(i)
            if len(out) == 2:
                break
        await stream.aclose()
        return out

    assert asyncio.run(take_two()) == [0, 1]
    assert closed.wait(5)


def test_calls_run_in_threads_of_their_own():
    from kvboost_rag.integration.async_stream import call_in_thread

    # More calls than the loop's default executor has workers, all running at the same time.
    count = 40
    barrier = threading.Barrier(count, timeout=20)

    async def run_all():
        return await asyncio.gather(*(call_in_thread(lambda i=i: (barrier.wait(), i)[1]) for i in range(count)))

    assert asyncio.run(run_all()) == list(range(count))


def test_call_errors_reach_the_caller():
    from kvboost_rag.integration.async_stream import call_in_thread

    def failing():
        raise KeyError("missing")

    with pytest.raises(KeyError, match="missing"):
        asyncio.run(call_in_thread(failing))
