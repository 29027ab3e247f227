"""The sim's sampler and stream pacing: a token depends on the request's own draws only (never on
the batch it ran in), the batched sampler draws what the one-by-one sampler draws, its tokens follow
the softmax, and a stream's updates come as SGLang's ``--stream-interval`` and per-request
``stream_interval`` say (the first token at once, then every N, then the end)."""

from __future__ import annotations

import random

import pytest
import torch

from pdctl.sim.engine_request import Request
from pdctl.sim.runner import _next_tokens
from pdctl.sim.sampling import SamplingOptions, sample, sample_plain
from tests.helpers import SimProcess, sse

VOCAB = 64


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn((rows, VOCAB), generator=torch.Generator().manual_seed(seed)) * 2


def test_the_batched_sampler_draws_what_the_one_by_one_sampler_draws() -> None:
    logits = _logits(16)
    temperatures = [0.3 + 0.1 * i for i in range(16)]
    draws = [random.Random(i).random() for i in range(16)]
    batched = sample_plain(logits, temperatures, draws)
    pairs = enumerate(zip(temperatures, draws, strict=True))
    alone = [sample(logits[i], SamplingOptions(temperature=t), d) for i, (t, d) in pairs]
    assert batched == alone
    assert len(set(batched)) > 4  # (the rows differ: this compares draws, not one constant)


def test_plain_sampling_follows_the_softmax() -> None:
    """20,000 draws of one row at temperature 0.7: each token's share within 0.012 of its softmax
    probability (a sampler that ignored the temperature, or picked token i-1, is off by more)."""
    row = _logits(1, seed=3)[0]
    rng = random.Random(11)
    n = 20_000
    tokens = sample_plain(row.expand(n, VOCAB), [0.7] * n, [rng.random() for _ in range(n)])
    shares = torch.bincount(torch.tensor(tokens), minlength=VOCAB).double() / n
    want = torch.softmax(row / 0.7, dim=-1).double()
    assert float((shares - want).abs().max()) < 0.012


def test_a_cut_distribution_never_yields_a_token_it_cut() -> None:
    row = _logits(1, seed=5)[0]
    opts = SamplingOptions(temperature=1.0, top_k=3)
    allowed = set(torch.topk(row, 3).indices.tolist())
    rng = random.Random(2)
    assert {sample(row, opts, rng.random()) for _ in range(500)} == allowed
    assert sample(row, opts, 0.0) in allowed and sample(row, opts, 1 - 2**-53) in allowed


def _request(i: int, opts: SamplingOptions) -> Request:
    req = Request(rid=str(i), input_ids=[1, 2, 3 + i], sampling=opts, emit=lambda _: None)
    req.rng = random.Random(1000 + i)
    req.output_ids.append(7)
    return req


@pytest.mark.parametrize("seeded", [False, True])
def test_a_request_draws_the_same_tokens_alone_or_in_any_batch(seeded: bool) -> None:
    """Eight requests of mixed options (greedy, plain temperatures, top-p and top-k cuts), three
    steps each: in one batch, in reversed order, and each alone, with the same logits per
    request; the tokens agree (a shared random stream, or a batch draw misassigned to rows,
    would not)."""
    kinds = [
        SamplingOptions(temperature=0.0),
        SamplingOptions(temperature=1.0),
        SamplingOptions(temperature=0.6),
        SamplingOptions(temperature=1.0, top_p=0.8),
        SamplingOptions(temperature=1.2, top_k=5),
        SamplingOptions(temperature=1.0),
        SamplingOptions(temperature=0.9, min_p=0.05),
        SamplingOptions(temperature=1.5),
    ]
    if seeded:
        kinds = [SamplingOptions(**{**o.__dict__, "sampling_seed": 40 + i}) for i, o in enumerate(kinds)]
    logits = [_logits(1, seed=100 + i)[0] for i in range(len(kinds))]

    def run(order: list[int]) -> dict[int, list[int | None]]:
        reqs = {i: _request(i, kinds[i]) for i in order}
        out: dict[int, list[int | None]] = {i: [] for i in order}
        for _ in range(3):
            batch = [reqs[i] for i in order]
            tokens = _next_tokens(batch, torch.stack([logits[i] for i in order]))
            for i, token in zip(order, tokens, strict=True):
                out[i].append(token)
                reqs[i].output_ids.append(token)
        return out

    together = run(list(range(8)))
    assert run(list(reversed(range(8)))) == together
    for i in range(8):
        assert run([i])[i] == together[i]


def _counts(events: list) -> list[int]:
    return [len(e["output_ids"]) for e in events if isinstance(e, dict)]


def test_the_runner_tells_a_stream_of_its_tokens_as_sglangs_output_streamer_does() -> None:
    """``stream_interval`` N: told at the first token, then whenever N are untold, then at the end;
    1: every token; 0 (a non-streamed answer): only the end."""
    from pdctl.sim.costed import NoKV, StandInForward
    from pdctl.sim.model import SimModelConfig
    from pdctl.sim.runner import ModelRunner

    class Queues:
        def finish(self, req: Request, reason: dict) -> None:
            req.finish = reason
            req.emit(req)

    runner = ModelRunner(StandInForward(SimModelConfig(), 4096), NoKV(), Queues(), capture_hidden_of=None,
                         prefill_ms_per_token=0, decode_ms_per_step=0, publish_kv=None, weight_version="v")  # fmt: skip
    for interval, told in ((4, [1, 5, 9, 10]), (3, [1, 4, 7, 10]), (1, list(range(1, 11))), (0, [10])):
        seen: list[int] = []
        req = Request(rid="r", input_ids=[1, 2], sampling=SamplingOptions(max_new_tokens=10, temperature=0),
                      emit=lambda r, seen=seen: seen.append(len(r.output_ids)), stream_interval=interval)  # fmt: skip
        for _ in range(10):
            runner._emit_token(req, 7, 0.0)
        assert seen == told, (interval, seen)


def test_stream_updates_follow_the_stream_interval(tmp_path) -> None:
    """Through HTTP: ``--stream-interval 4``'s stream of 10 tokens has updates only at 1, 5, 9 and
    10 (a client slower than the engine may get fewer: updates not yet read are merged, as SGLang's
    tokenizer manager merges them); a request's own ``stream_interval`` 3 wins (1, 4, 7, 10)."""
    sim = SimProcess(tmp_path, "--stream-interval", "4").start()
    try:
        body = {"text": "pace", "sampling_params": {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True},
                "stream": True}  # fmt: skip
        counts = _counts(sse(sim.url + "/generate", body))
        assert counts[-1] == 10 and set(counts) <= {1, 5, 9, 10}, counts
        body["sampling_params"]["stream_interval"] = 3
        counts = _counts(sse(sim.url + "/generate", body))
        assert counts[-1] == 10 and set(counts) <= {1, 4, 7, 10}, counts
    finally:
        sim.stop()
