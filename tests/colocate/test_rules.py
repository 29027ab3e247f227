"""What a data-plane topology may not be, and what a running one may not become: each rule fails
without it."""

from __future__ import annotations

import json

import pytest

from pdctl.cluster.apply import diff
from pdctl.cluster.state import ClusterState, Phase, declared_of
from pdctl.plan import make_plan
from pdctl.topology import load_topology_text
from tests.conftest import yaml_text
from tests.helpers import one_error

HEAD = (
    "name: c\nmodel: {path: sim://tiny}\nengine: sim\nnodes: [{name: n0, host: 127.0.0.1, gpus: 4}]\n"
    "trainer: {command: [python, t.py]}\n"
)
COLO = "placement: {mode: colocate, train_frac: 0.4, infer_frac: 0.4, mps: false, data_plane: %s}\n"


@pytest.mark.parametrize(
    "flag",
    [
        "forward-hooks: '[]'",
        "enable-mixed-chunk: true",
        "enable-two-batch-overlap: true",
        "speculative-algorithm: EAGLE",
        "cuda-graph-backend-prefill: breakable",
        "cuda-graph-config: '{}'",
    ],
)
def test_flags_that_break_the_hooks_assumptions_are_refused(flag) -> None:
    name = flag.split(":")[0]
    one_error(HEAD + f"regular: {{tp: 4, args: {{{flag}}}}}\n" + COLO % "{}", f"regular.args.{name}", f"--{name}")


def test_null_is_no_data_plane_and_the_backend_is_one_that_works_on_its_engines() -> None:
    """NCCL refuses two ranks on one GPU (seen: NCCL 2.28.9, H100), so a data plane never runs on
    it; the sim's is gloo (it runs on CPU), a GPU engine's cuda_ipc unless the file says gloo."""
    top, _ = load_topology_text(yaml_text(HEAD + "regular: {tp: 4}\n" + COLO % "null"))
    assert top.placement.data_plane is None and make_plan(top).data_plane is None
    one_error(HEAD + "regular: {tp: 4}\n" + COLO % "{backend: nccl}", "placement.data_plane.backend", "Duplicate GPU")
    one_error(HEAD + "regular: {tp: 4}\n" + COLO % "{backend: cuda_ipc}", "placement.data_plane.backend", "CPU")
    sim, _ = load_topology_text(yaml_text(HEAD + "regular: {tp: 4}\nweights: {backend: nccl}\n" + COLO % "{}"))
    assert make_plan(sim).data_plane.backend == "gloo"  # (the weights' backend is not the data plane's)
    gpu = HEAD.replace("engine: sim", "engine: sglang").replace("sim://tiny", "/m")
    for written, planned in (("{}", "cuda_ipc"), ("{backend: gloo}", "gloo"), ("{backend: cuda_ipc}", "cuda_ipc")):
        top, _ = load_topology_text(yaml_text(gpu + "regular: {tp: 4}\n" + COLO % written))
        assert make_plan(top).data_plane.backend == planned, written


def test_the_join_timeout_is_what_the_file_says_and_reaches_every_rank() -> None:
    """Engines join once their model is loaded, which can take longer than the default 15 minutes."""
    from pdctl.colocate.env import DATA_PLANE_ENV, DataPlaneSpec

    top, _ = load_topology_text(yaml_text(HEAD + "regular: {tp: 4}\n" + COLO % "{join_timeout_secs: 3600}"))
    plan = make_plan(top)
    assert plan.data_plane is not None and plan.data_plane.join_timeout_secs == 3600
    for process in ("trainer.n0", "regular-0"):
        assert DataPlaneSpec.from_json(plan.process(process).env[DATA_PLANE_ENV]).join_timeout_secs == 3600
    default, _ = load_topology_text(yaml_text(HEAD + "regular: {tp: 4}\n" + COLO % "{}"))
    assert make_plan(default).data_plane.join_timeout_secs == 900
    placement = COLO % "{join_timeout_secs: 0}"
    err = one_error(HEAD + "regular: {tp: 4}\n" + placement, "placement.data_plane.join_timeout_secs")
    assert err.startswith(f"f.yaml:7:{placement.index('join_timeout') + 1}: "), err  # (the key's line and column)


def test_apply_refuses_to_change_the_union_world_of_a_running_cluster() -> None:
    """Its settings, or the engines it pairs (here one more replica), would leave the running
    trainer in a world its new engines can never join."""
    running, _ = load_topology_text(yaml_text(HEAD + "regular: {replicas: 2, tp: 2}\n" + COLO % "{batch_size: 4}"))
    plan = make_plan(running)
    state = ClusterState(name="c", run_id="r", status=Phase.UP, nodes=[], plan=plan, declared=declared_of(running))
    json.dumps(state.declared)  # (kept in the state file)
    for change in ("regular: {replicas: 2, tp: 2}\n" + COLO % "{batch_size: 8}",
                   "regular: {replicas: 2, tp: 2}\n" + COLO % "{batch_size: 4, aux_layers: [1]}",
                   "regular: {replicas: 1, tp: 2}\n" + COLO % "{batch_size: 4}"):  # fmt: skip
        edited, _ = load_topology_text(yaml_text(HEAD + change))
        refused = diff(state, edited, make_plan(edited)).refused
        assert [r.split(":")[0] for r in refused] == ["placement.data_plane"], refused
    same, _ = load_topology_text(yaml_text(HEAD + "regular: {replicas: 2, tp: 2}\n" + COLO % "{batch_size: 4}"))
    assert diff(state, same, make_plan(same)).refused == []


def test_planning_a_data_plane_imports_no_torch() -> None:
    """The control machine installs no torch: validating and planning a data-plane topology, and
    printing its plan, must not import it (pdctl.colocate.env is torch-free)."""
    import subprocess
    import sys

    from tests.conftest import REPO

    code = (
        "import sys\n"
        "from pdctl.plan import load_plan\n"
        "from pdctl.cli.topology_cmds import render_plan\n"
        f"plan = load_plan({str(REPO / 'topologies' / 'colocate-draft.yaml')!r}).plan\n"
        "render_plan(plan)\n"
        "assert plan.data_plane is not None\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "data plane: cuda_ipc world_size=16" in done.stdout
