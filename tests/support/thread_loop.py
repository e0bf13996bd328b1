"""An asyncio event loop in a daemon thread, for tests that drive async servers and engines from the test's thread."""
import asyncio
import concurrent.futures
import threading


class Loop:
    """``run(coro)`` waits for the coroutine on the loop's thread; ``submit(coro)`` returns its future."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout=600):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def submit(self, coro) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def stop(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
