"""The decode loop's prompt scoring (``GenerationRequest.prompt_logprobs``):
a request that asks is scored before it is queued, one prompt at a time on
a thread of its own (what the scores are: ``prompt_scores``)."""
from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor

from .generation import FINISH_LENGTH
from .prompt_scores import PromptScores

log = logging.getLogger(__name__)


class PromptScorer:
    """Scores submitted requests' prompts one at a time, on a thread of its
    own (not the loop's default executor, whose threads carry the sampler
    calls: a burst of long prompts would stall every lane's sampling), then
    queues each request in its decoder. A request that ended meanwhile
    (cancelled, ``Decoder.abort_all``) is not scored, or its scores are
    dropped."""

    def __init__(self, decoder):
        self.decoder = decoder
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prompt-scores")
        self.tasks: set[asyncio.Task] = set()  # held until each ends

    def submit(self, sequence) -> None:
        """Score `sequence` (``DecodeSequence``; its request asked for
        ``prompt_logprobs``), hand the scores to its client as an event
        without tokens, then queue it, or end it ``"length"`` when it asked
        for no tokens. A failed scoring ends it with the error, logged with
        its traceback."""
        task = asyncio.get_running_loop().create_task(self._score_then_queue(sequence))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def close(self) -> None:
        """Stop: scorings not started are dropped, the running one ends."""
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.executor.shutdown(wait=True, cancel_futures=True)

    def _score(self, sequence) -> PromptScores | None:
        if sequence.done:  # ended while waiting its turn: not worth a forward
            return None
        return self.decoder.engine.score_prompt(sequence.prompt_ids,
                                                sequence.request.prompt_logprobs)

    async def _score_then_queue(self, sequence) -> None:
        decoder = self.decoder
        try:
            scores = await asyncio.get_running_loop().run_in_executor(
                self.executor, self._score, sequence)
        except Exception as error:  # noqa: BLE001 - ours: this request ends, the others go on
            if not sequence.done:
                log.exception("scoring a prompt failed")
                decoder.finish(sequence, error=f"scoring the prompt failed: {error}")
            return
        if sequence.done:
            return
        event = sequence.event("", [], [])
        event.prompt_scores = scores
        sequence.handle.put(event)
        if sequence.request.max_tokens == 0:
            decoder.finish(sequence, FINISH_LENGTH)
        else:
            decoder.enqueue(sequence)
