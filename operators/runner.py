"""Drives many memory chains at once against one engine.

Each chain submits its next step as soon as its previous step returns, so the engine batches
everyone's steps together and a long document never holds short ones back. Longest first: a
chain's requests carry its document tokens still to read as their priority, and chains take
slots in the same order (the first free ones too, for chains given together to `run`), so the
chain on the critical path never queues behind short ones and the run's tail is short.
`longest_first=False` keeps the order of arrival.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field

from operators.core.chain import ChainStatus, MemoryChain, StepRecord
from operators.engine import Engine, GenerationRequest, SamplingConfig


@dataclass
class ChainResult:
    chain_id: str
    question: str
    status: ChainStatus  # DONE, or FAILED with `error`
    answer: str | None = None
    raw_response: str | None = None
    final_memory: str = ""
    n_segments: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    elapsed_s: float = 0.0
    error: str | None = None
    trajectory: list[StepRecord] = field(default_factory=list)


StepCallback = Callable[[MemoryChain, StepRecord], Awaitable[None] | None]


class ChainRunner:
    def __init__(
        self,
        engine: Engine,
        sampling: SamplingConfig = SamplingConfig(),
        max_active_chains: int = 256,
        *,
        longest_first: bool = True,
        admission_settle_s: float = 0.0,
    ) -> None:
        """`admission_settle_s`: how long free slots wait for more chains to ask before the
        waiting ones are admitted by priority (see `PriorityGate`); for chains that arrive one
        by one rather than together through `run`."""
        self.engine = engine
        self.sampling = sampling
        self.longest_first = longest_first
        self._slots = PriorityGate(max_active_chains, settle_s=admission_settle_s)

    async def run(
        self, chains: Iterable[MemoryChain], on_step: StepCallback | None = None
    ) -> list[ChainResult]:
        """Runs every chain; results in the order given. Longest first, the chains also ask for
        a slot in that order, so the first free slots go to the longest, not the first listed."""
        chains = list(chains)
        order = list(range(len(chains)))
        if self.longest_first:
            order.sort(key=lambda i: -chains[i].tokens_left)  # stable: ties keep their order
        results = await asyncio.gather(*(self.run_chain(chains[i], on_step) for i in order))
        by_index = dict(zip(order, results, strict=True))
        return [by_index[i] for i in range(len(chains))]

    async def run_chain(
        self, chain: MemoryChain, on_step: StepCallback | None = None
    ) -> ChainResult:
        """Runs one chain to its answer. Failures become a result with status FAILED."""
        result = ChainResult(
            chain.chain_id, chain.question, ChainStatus.DONE, n_segments=len(chain.segments)
        )
        started = time.perf_counter()
        async with self._slots.slot(-chain.tokens_left if self.longest_first else 0):
            try:
                while (request := chain.next_request()) is not None:
                    completion = await self.engine.generate(
                        GenerationRequest(
                            request.request_id,
                            request.prompt,
                            request.max_tokens,
                            self.sampling,
                            priority=-chain.tokens_left if self.longest_first else 0,
                        )
                    )
                    chain.submit(completion.text)
                    record = StepRecord.after(chain, request, completion)
                    result.trajectory.append(record)
                    result.prompt_tokens += completion.prompt_tokens
                    result.completion_tokens += completion.completion_tokens
                    if on_step is not None and (pending := on_step(chain, record)) is not None:
                        await pending
            except Exception as error:  # one failing chain must not stop the others
                result.status = ChainStatus.FAILED
                result.error = f"{type(error).__name__}: {error}"
        result.final_memory = chain.memory
        result.raw_response = chain.raw_response
        result.answer = chain.answer
        result.elapsed_s = time.perf_counter() - started
        return result


class PriorityGate:
    """At most `slots` holders at once; waiters get a freed slot lowest priority value first,
    ties in order of arrival.

    With `settle_s`, a free slot is not handed to whoever asks first: the gate waits until no
    one new has asked for `settle_s` (at most `max_settle_s` in all), then admits the waiters by
    priority. Requests that come in a burst, such as a job's documents reaching an engine that
    has just started, one store call apart, are then admitted longest first, not first come."""

    def __init__(self, slots: int, settle_s: float = 0.0, max_settle_s: float = 5.0) -> None:
        self._free = slots
        self._waiting: list[tuple[int, int, asyncio.Future[None]]] = []
        self._arrivals = itertools.count()
        self._settle_s = settle_s
        self._max_settle_s = max_settle_s
        self._settling: asyncio.TimerHandle | None = None
        self._settling_since = 0.0

    @contextlib.asynccontextmanager
    async def slot(self, priority: int) -> AsyncIterator[None]:
        if self._free > 0 and not self._waiting and not self._settle_s:
            self._free -= 1
        else:
            granted = asyncio.get_running_loop().create_future()
            heapq.heappush(self._waiting, (priority, next(self._arrivals), granted))
            if self._free > 0:
                self._settle()
            try:
                await granted
            except asyncio.CancelledError:
                if granted.done() and not granted.cancelled():
                    self._release()  # granted just as it was cancelled: pass the slot on
                else:
                    self._waiting = [w for w in self._waiting if w[2] is not granted]
                    heapq.heapify(self._waiting)
                raise
        try:
            yield
        finally:
            self._release()

    def _settle(self) -> None:
        """Admits the waiters once arrivals pause for `settle_s` (each one restarts the wait)."""
        loop = asyncio.get_running_loop()
        if self._settling is None:
            self._settling_since = loop.time()
        else:
            self._settling.cancel()
        due = min(loop.time() + self._settle_s, self._settling_since + self._max_settle_s)
        self._settling = loop.call_at(due, self._admit)

    def _admit(self) -> None:
        self._settling = None
        while self._free > 0 and self._waiting:
            _, _, waiter = heapq.heappop(self._waiting)
            if not waiter.done():
                self._free -= 1
                waiter.set_result(None)

    def _release(self) -> None:
        while self._waiting:
            _, _, waiter = heapq.heappop(self._waiting)
            if not waiter.done():
                waiter.set_result(None)  # the slot passes straight to the waiter
                return
        self._free += 1
