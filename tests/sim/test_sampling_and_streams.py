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


def test_stream_updates_follow_the_stream_interval(tmp_path) -> None:
    """``--stream-interval 4``: 10 tokens stream as 1, 5, 9, 10 (the first at once, then whenever
    4 are unsent, then the end: SGLang's output streamer); a request's own ``stream_interval`` 3
    wins (1, 4, 7, 10); a non-streamed answer is whole."""
    sim = SimProcess(tmp_path, "--stream-interval", "4").start()
    try:
        body = {"text": "pace", "sampling_params": {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True},
                "stream": True}  # fmt: skip
        assert _counts(sse(sim.url + "/generate", body)) == [1, 5, 9, 10]
        body["sampling_params"]["stream_interval"] = 3
        assert _counts(sse(sim.url + "/generate", body)) == [1, 4, 7, 10]
    finally:
        sim.stop()
    plain = SimProcess(tmp_path, name="every").start()
    try:
        body = {"text": "pace", "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
                "stream": True}  # fmt: skip
        assert _counts(sse(plain.url + "/generate", body)) == [1, 2, 3, 4, 5, 6]
    finally:
        plain.stop()
