"""The data plane's pieces without a network: the wire header, the packed metadata, the union
world's ranks, the hook specs, and the shard that is sent without a copy."""

from __future__ import annotations

import base64
import json

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from pdctl.colocate.engine import _adjacent_span
from pdctl.colocate.env import DataPlaneSpec, EngineRanks, hook_specs
from pdctl.colocate.wire import Header, pack_meta, unpack_meta


def test_header_round_trip_and_garbage_refused() -> None:
    header = Header(step=7, n_seqs=3, n_tokens=40, hidden=1024, n_aux=2, dtype=torch.bfloat16)
    assert Header.decode(header.encode()) == header
    with pytest.raises(ValueError, match="not a data plane header"):
        Header.decode(torch.zeros(8, dtype=torch.int64))
    bad = header.encode()
    bad[6] = 99  # no such dtype code
    with pytest.raises(ValueError):
        Header.decode(bad)


def test_meta_packs_ids_lengths_and_the_next_token_mask() -> None:
    seqs = [torch.tensor([5, 6, 7]), torch.tensor([8]), torch.tensor([9, 10])]
    meta = pack_meta(seqs)
    header = Header(0, 3, 6, 4, 0, torch.float32)
    assert meta.numel() == header.meta_len
    ids, lens, mask = unpack_meta(meta, header)
    assert ids.tolist() == [5, 6, 7, 8, 9, 10] and lens.tolist() == [3, 1, 2]
    assert mask.tolist() == [1, 1, 0, 0, 1, 0]


def test_union_ranks_pair_trainer_rank_i_with_engine_gpu_i() -> None:
    spec = DataPlaneSpec(
        master_address="10.0.0.1",
        master_port=20000,
        trainer_ranks=3,
        engines=(EngineRanks(id="a", tp=1, first_rank=3), EngineRanks(id="b", tp=2, first_rank=4)),
        aux_layers=(2, 5),
    )
    assert spec.world_size == 6
    assert [(e.id, tp) for e, tp in map(spec.pair_of_trainer, range(3))] == [("a", 0), ("b", 0), ("b", 1)]
    assert [spec.trainer_of(spec.engine("b"), j) for j in (0, 1)] == [1, 2]
    assert DataPlaneSpec.from_json(spec.to_json()) == spec
    with pytest.raises(ValueError, match="PDCTL_DATA_PLANE is not a data plane spec"):
        DataPlaneSpec.from_json('{"master_address": "x"}')
    hooks = hook_specs("b", positions_module="model.embed_positions", aux_layers=(2, 5))
    assert [h["target_modules"] for h in hooks] == [
        ["model.embed_tokens"], ["model.embed_positions"], ["model.layers.2", "model.layers.5"], ["model.norm"]
    ]  # fmt: skip


def test_a_shard_of_adjacent_rows_is_sent_as_a_view_else_joined() -> None:
    forward = torch.arange(40.0).view(20, 2)
    view = _adjacent_span([forward[0:5], forward[5:6], forward[6:20]])
    assert view is not None and view.data_ptr() == forward.data_ptr() and torch.equal(view, forward)
    assert _adjacent_span([forward[0:5], forward[6:8]]) is None  # a gap
    assert _adjacent_span([forward[0:5], torch.arange(40.0).view(20, 2)[5:8]]) is None  # another forward
    assert _adjacent_span([forward[5:8], forward[0:5]]) is None  # out of order


def test_forwards_are_cut_into_whole_prompts_and_steps_of_own_shards() -> None:
    """Two prompts per forward and one more, batch 4 over TP 2, this process playing TP rank 1
    only: the step completes on the 4th prompt and holds prompts 2 and 3; decode rows, the health
    probe and a chunk that does not start at 0 are not prompts."""
    from pdctl.colocate.steps import StepCutter

    cutter = StepCutter(batch_size=4, tp=2, tp_ranks=[1])
    hidden = torch.arange(24.0).view(12, 2)

    def forward(positions: list[int], ids: list[int]):
        rows = hidden[: len(positions)]
        return cutter.add(torch.tensor(ids), torch.tensor(positions), rows, ((rows, rows),))

    assert forward([5, 9], [1, 2]) == []  # decode rows
    assert forward([0], [0]) == []  # GET /health's probe
    assert forward([3, 4, 5], [7, 7, 7]) == [] and cutter.in_step == 0  # a later chunk of a long prompt
    assert forward([0, 1, 0, 1, 2], [10, 11, 20, 21, 22]) == [] and cutter.in_step == 2  # prompts 0, 1 (rank 0's)
    (step,) = forward([0, 1, 0, 0, 1], [30, 31, 40, 50, 51])  # prompts 2, 3 complete the step; 4 opens the next
    assert list(step) == [1] and [p.input_ids.tolist() for p in step[1]] == [[30, 31], [40]]
    assert torch.equal(step[1][0].final, hidden[0:2]) and torch.equal(step[1][1].aux[0], 2 * hidden[2:3])
    assert cutter.in_step == 1


def test_a_forward_under_cuda_graph_capture_is_not_data(monkeypatch) -> None:
    """SGLang captures its decode CUDA graphs by running forwards of dummy rows: the cutter takes
    nothing from them (and makes no host copy, which would break the capture)."""
    from pdctl.colocate import steps

    cutter = steps.StepCutter(batch_size=1, tp=1, tp_ranks=[0])
    hidden = torch.ones(3, 2)
    monkeypatch.setattr(steps, "capturing", lambda: True)
    assert cutter.add(torch.tensor([5, 6, 7]), torch.tensor([0, 1, 2]), hidden, ()) == [] and cutter.in_step == 0
    monkeypatch.setattr(steps, "capturing", lambda: False)
    assert len(cutter.add(torch.tensor([5, 6, 7]), torch.tensor([0, 1, 2]), hidden, ())) == 1


def test_a_process_plays_its_own_tp_rank_under_sglang_and_every_rank_elsewhere(monkeypatch) -> None:
    import sys
    import types

    from pdctl.colocate.engine import local_tp_ranks

    monkeypatch.delitem(sys.modules, "sglang.srt.distributed.parallel_state", raising=False)
    assert local_tp_ranks(4) == [0, 1, 2, 3]  # the sim: one process for the engine's ranks
    state = types.SimpleNamespace(model_parallel_is_initialized=lambda: True, get_tensor_model_parallel_rank=lambda: 2)
    monkeypatch.setitem(sys.modules, "sglang.srt.distributed.parallel_state", state)
    assert local_tp_ranks(4) == [2]  # an SGLang TP worker whose parallel state is set up
    state.model_parallel_is_initialized = lambda: False
    assert local_tp_ranks(4) == [0, 1, 2, 3]


def test_a_cuda_ipc_handle_travels_as_plain_fields_and_garbage_is_refused() -> None:
    """The handle comes off a socket: JSON of plain fields (no pickle), every field checked."""
    from pdctl.colocate.ipc import Handle

    handle = Handle(
        gpu_uuid="GPU-91dc1fd1",
        nbytes=1024,
        ipc_handle=bytes(range(64)),
        storage_bytes=2048,
        offset_bytes=512,
        ref_counter_handle=b"/torch_123_456_0",  # (the form torch gives it)
        ref_counter_offset=3,
        event_handle=None,
        event_sync_required=False,
    )
    assert Handle.decode(handle.encode()) == handle
    fields = json.loads(handle.encode())
    changed = [
        ("nbytes", "x"), ("nbytes", -1), ("nbytes", 1e999), ("nbytes", True), ("nbytes", 1024.0),
        ("event_sync_required", "false"),
        # the opener increments a counter in the named shared-memory file: only torch's own
        # names, and only inside the file (a slot past its 10000 would be a write outside)
        ("ref_counter_handle", base64.b64encode(b"/psm_victim").decode()), ("ref_counter_offset", 10_000),
        ("ipc_handle", ""), ("event_sync_required", True),  # (an event required, none given)
    ]  # fmt: skip
    hostile = [b"[" * 200_000, b" " * 5000, *(json.dumps({**fields, k: v}).encode() for k, v in changed)]
    for garbage in (b"", b"\x80", b"[]", b'{"gpu_uuid": "x"}', *hostile):
        with pytest.raises(ValueError, match="not a CUDA IPC handle"):
            Handle.decode(garbage)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("n_tokens", "hidden", "n_aux"), [(1, 1, 0), (3, 5, 2), (7, 33, 3), (64, 256, 1)])
def test_a_cuda_ipc_layout_gives_aligned_views_that_do_not_overlap(dtype, n_tokens, hidden, n_aux) -> None:
    """Both ends take their views of the buffer from IpcLayout: each block and the meta start on
    a 256-byte boundary, fit in ``size``, and writing one never touches another."""
    from pdctl.colocate.wire import ALIGN, IpcLayout

    header = Header(0, 2, n_tokens, hidden, n_aux, dtype)
    layout = IpcLayout.of(header)
    buffer = torch.zeros(layout.size, dtype=torch.uint8)
    blocks, meta = layout.views(buffer, header)
    assert len(blocks) == 1 + n_aux and meta.numel() == header.meta_len and meta.dtype == torch.int64
    for k, block in enumerate(blocks):
        assert block.shape == (n_tokens, hidden) and block.dtype == dtype
        assert (block.data_ptr() - buffer.data_ptr()) % ALIGN == 0
        block.fill_(k + 1)
    assert (meta.data_ptr() - buffer.data_ptr()) % ALIGN == 0
    meta.fill_(-1)
    assert bool((meta == -1).all())
    assert all(bool((b == k + 1).all()) for k, b in enumerate(blocks))


def test_a_data_plane_spec_names_a_backend_that_exists() -> None:
    spec = DataPlaneSpec(master_address="h", master_port=1, trainer_ranks=1, engines=(), backend="cuda_ipc")
    assert DataPlaneSpec.from_json(spec.to_json()) == spec
    with pytest.raises(ValueError, match="backend 'nccl'"):
        DataPlaneSpec.from_json(spec.to_json().replace("cuda_ipc", "nccl"))


def _prompts_one_by_one(ids: list[int], positions: list[int]) -> tuple[list[tuple[int, int]], list[int]]:
    """The rule, segment by segment, as the docstring of pdctl.colocate.steps states it."""
    starts = [i for i, p in enumerate(positions) if p == 0]
    whole, partial = [], []
    for start, end in zip(starts, [*starts[1:], len(positions)][: len(starts)], strict=True):
        if end - start == 1 and ids[start] == 0:
            continue
        if positions[start:end] == list(range(end - start)):
            whole.append((start, end))
        else:
            partial.append(end - start)
    return whole, partial


@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 2)), max_size=40))
def test_prompts_are_found_in_one_pass_as_segment_by_segment(rows) -> None:
    """The vectorised cut (two host syncs per forward) agrees with the rule read one segment at a
    time, on any mix of prompts, chunks, decode rows and health probes."""
    from pdctl.colocate.steps import _prompts

    positions, ids = [p for p, _ in rows], [i for _, i in rows]
    partial: list[int] = []
    got, host_ids = _prompts(torch.tensor(ids), torch.tensor(positions, dtype=torch.int64), partial.append)
    assert (got, partial) == _prompts_one_by_one(ids, positions) and host_ids.tolist() == ids
