"""What each request holds of a profile engine's KV pool, and what each round costs in modelled time.

The pool itself (tokens, prefix cache, eviction) and the profile's timings are pdctl.sim.costed's;
this module applies them to the engine's requests (pdctl.sim.engine_request): which tokens a
request needs at admission, which it leaves cached when it ends, and how long the GPU would
take to prefill an admitted batch or step the running one. A plain engine (no ``--sim-profile``)
holds no reserve and models no time: only ``free`` and ``tokens`` are called for it.
"""

from __future__ import annotations

from pdctl.sim.costed import CostedPool, Held
from pdctl.sim.engine_request import Mode, Request

__all__ = ["KVBudget"]


class KVBudget:
    """The engine's KV accounting: a profile engine's ``CostedPool`` seen per request, or (``costed``
    None) a plain engine's slots of the context length. Owned by the scheduler thread, like the
    pool it wraps; ``tokens`` may be read under the queues' lock from any thread."""

    def __init__(self, costed: CostedPool | None, capacity: int, context: int):
        self.costed = costed
        self._capacity = capacity
        self._context = context

    def hold(self, req: Request) -> Held | None:
        """Room in the pool for ``req``, its cached prefix locked; None when it must wait. Profile engines only."""
        assert self.costed is not None
        decode_kv = req.mode is Mode.DECODE and req.kv is not None and req.retractions == 0
        ids = req.input_ids + req.output_ids[:-1] if req.output_ids else req.input_ids
        left = 1 if req.mode is Mode.PREFILL else req.sampling.max_new_tokens - len(req.output_ids)
        return self.costed.admit(ids, left, prefill=not decode_kv, use_cache=req.mode is not Mode.DECODE)

    def free(self, req: Request) -> None:
        """Give back ``req``'s reserve; a request that ended normally leaves its tokens cached
        (a PD prefill its prompt; a PD decode caches nothing, as SGLang's decode side). A request
        that holds nothing (a plain engine's, or one never admitted) is left as it is."""
        held, req.held = req.held, None
        if held is None or self.costed is None:
            return
        keep: list[int] | None = None
        if req.finished and req.mode is not Mode.DECODE and (req.finish or {}).get("type") != "abort":
            keep = req.input_ids + req.output_ids[:-1] if req.mode is Mode.NORMAL else req.input_ids
        self.costed.release(held, keep)

    def prefill_ms(self, admit: list[Request]) -> float:
        """The modelled time of one prefill batch of ``admit`` (their uncached tokens). Profile engines only."""
        assert self.costed is not None
        prompts = [(r.held.new_tokens, r.held.cached) for r in admit if r.held is not None and r.held.new_tokens]
        return self.costed.profile.prefill_ms(prompts)

    def decode_ms(self, running: list[Request]) -> float:
        """The modelled time of one decode step over the unfinished ones of ``running``. Profile engines only."""
        assert self.costed is not None
        batch = [r for r in running if not r.finished]
        return self.costed.profile.decode_step_ms(len(batch), sum(r.kv_len for r in batch))

    def tokens(self, free_slots: int) -> tuple[int, int]:
        """(KV tokens used, KV tokens in all): a profile engine's pool; otherwise ``free_slots``
        of ``capacity`` slots of the context length each are free."""
        if self.costed is not None:
            return self.costed.used, self.costed.total
        total = self._capacity * self._context
        return total - free_slots * self._context, total
