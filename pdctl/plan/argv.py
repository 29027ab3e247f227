"""Command lines: SGLang (or sim) servers, torchrun, the router. Full flag names only.

``engine: sim`` gets exactly the flags ``engine: sglang`` gets, behind ``-m pdctl.sim``.
"""

from __future__ import annotations

import json

from pdctl.colocate.env import hook_specs
from pdctl.refit import RefitMode
from pdctl.roles import Role
from pdctl.router.config import Flag, flag_of
from pdctl.sglang import render_extra_args
from pdctl.topology.model import Node, ServerGroup, Topology
from pdctl.weights.env import CONTROL_KEYS_ENV, ENGINE_KEY_ENV

ENGINE_MODULES = {"sglang": "sglang.launch_server", "sim": "pdctl.sim"}


def engine_argv(
    top: Topology,
    group: ServerGroup,
    node: Node,
    *,
    gpu_ids: tuple[int, ...],
    http_port: int,
    nccl_port: int,
    bootstrap_port: int | None,
    dist_init_addr: str | None,
    nnodes: int,
    node_rank: int,
    engine_id: str,
) -> tuple[str, ...]:
    """argv of one engine server process (node rank ``node_rank`` of ``nnodes``) of ``engine_id``."""
    argv = [node.python, "-m", ENGINE_MODULES[top.engine], "--model-path", top.model.path]
    if top.model.served_name:
        argv += ["--served-model-name", top.model.served_name]
    if top.model.tokenizer:
        argv += ["--tokenizer-path", top.model.tokenizer]
    if top.model.dtype:
        argv += ["--dtype", top.model.dtype]
    bind = "127.0.0.1" if node.host == "localhost" else node.host
    argv += ["--host", bind, "--port", str(http_port), "--tp-size", str(group.tp)]
    if group.dp > 1:
        argv += ["--dp-size", str(group.dp)]
    if group.pp > 1:
        argv += ["--pp-size", str(group.pp)]
    if group.attn_dp > 1:
        argv += ["--attn-dp-size", str(group.attn_dp)]
    argv += ["--base-gpu-id", str(gpu_ids[0]), "--nccl-port", str(nccl_port)]
    if group.role in (Role.PREFILL, Role.DECODE):
        argv += ["--disaggregation-mode", group.role.value]
        if bootstrap_port is not None:
            argv += ["--disaggregation-bootstrap-port", str(bootstrap_port)]
        if group.transfer_backend:
            argv += ["--disaggregation-transfer-backend", group.transfer_backend]
        if group.ib_device:
            argv += ["--disaggregation-ib-device", group.ib_device]
        if group.role_switch:
            argv.append("--enable-pd-role-switch")
    if dist_init_addr:
        argv += ["--dist-init-addr", dist_init_addr, "--nnodes", str(nnodes), "--node-rank", str(node_rank)]
    extra = dict(group.args)
    if "enable-metrics" not in extra:  # /metrics for `pdctl bench`'s server view and for scrapers
        argv.append("--enable-metrics")
    if top.placement.colocate and top.placement.infer_frac and "mem-fraction-static" not in extra:
        extra["mem-fraction-static"] = top.placement.infer_frac
    if top.placement.colocate and top.placement.data_plane is not None:
        extra.update(_data_plane_args(top, engine_id, top.placement.data_plane.aux_layers))
    argv += render_extra_args(extra)
    return tuple(argv)


POSITIONS_MODULE = {"sim": "model.embed_positions", "sglang": "model.layers.0.self_attn.rotary_emb"}
"""A module whose first input is the positions of the forward's rows (the sim's learned position
table; SGLang's Llama/Qwen rotary embedding, called as ``rotary_emb(positions, q, k)``)."""


def _data_plane_args(top: Topology, engine_id: str, aux_layers: tuple[int, ...]) -> dict[str, object]:
    """The data plane's engine flags: its hooks (``--forward-hooks``), whole-prompt prefills
    (``--disable-radix-cache``), no warm-up prompt in the data (``--skip-server-warmup``), and
    prefills run eagerly (``--disable-prefill-cuda-graph``: SGLang 0.5.23 captures prefills into
    CUDA graphs by default on CUDA, and a graph's replay runs no forward hooks)."""
    hooks = hook_specs(engine_id, positions_module=POSITIONS_MODULE[top.engine], aux_layers=aux_layers)
    return {
        "forward-hooks": compact_json(hooks),
        "disable-radix-cache": True,
        "skip-server-warmup": True,
        "disable-prefill-cuda-graph": True,
    }


def trainer_argv(
    top: Topology, node: Node, *, nnodes: int, node_rank: int, nproc: int, master_addr: str, master_port: int
) -> tuple[str, ...]:
    """torchrun (``python -m torch.distributed.run``) for one trainer node.

    ``python script.py ...`` runs under torchrun's own interpreter (the node's); ``python -m
    mod`` becomes ``-m mod``; ``python -c ...`` and other interpreter flags run the node's
    interpreter with ``--no-python``; anything else runs as is with ``--no-python``.
    """
    assert top.trainer is not None
    cmd = list(top.trainer.command)
    argv = [
        node.python,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(nnodes),
        "--node-rank",
        str(node_rank),
        "--nproc-per-node",
        str(nproc),
        "--master-addr",
        master_addr,
        "--master-port",
        str(master_port),
    ]
    # "--" ends torchrun's options: its parser would otherwise read a trainer flag that abbreviates
    # one of its own (--log for --log-dir, --log-specs: "ambiguous option") and exit 2.
    if cmd[0] in ("python", "python3") and len(cmd) > 1:
        if cmd[1] == "-m" and len(cmd) > 2:
            return (*argv, "-m", "--", *cmd[2:])
        if cmd[1].startswith("-"):
            return (*argv, "--no-python", "--", node.python, *cmd[1:])
        return (*argv, "--", *cmd[1:])
    return (*argv, "--no-python", "--", *cmd)


def router_argv(
    top: Topology,
    node: Node,
    *,
    port: int,
    metrics_port: int,
    prefill: list[tuple[str, int | None]],
    decode: list[str],
    regular: list[str],
) -> tuple[str, ...]:
    """``python -m pdctl router ...`` with every worker of the plan."""
    r = top.router
    argv = [node.python, "-m", "pdctl", "router", Flag.HOST, r.host, Flag.PORT, str(port)]
    argv += [Flag.PROMETHEUS_PORT, str(metrics_port), Flag.POLICY, r.policy]
    if r.prefill_policy:
        argv += [Flag.PREFILL_POLICY, r.prefill_policy]
    if r.decode_policy:
        argv += [Flag.DECODE_POLICY, r.decode_policy]
    for group, values in r.settings.items():  # what the file sets; flags spelled once, in the router's table
        for name, value in values.items():
            flag = flag_of(group, name)
            if isinstance(value, bool):
                argv += [flag] if value else []  # a switch; false is its default
            else:
                argv += [flag, f"{value:g}" if isinstance(value, float) else str(value)]
    if r.api_key_env:
        argv += [Flag.API_KEY_ENV, r.api_key_env]
    if r.control_open_from:
        argv += [Flag.OPEN_FROM, *r.control_open_from]
    weights = top.weights
    if weights is not None and weights.refit is not RefitMode.DRAIN:  # a framework's updates through the facade
        argv += [Flag.REFIT, weights.refit.value]
        if weights.max_staleness is not None:
            argv += [Flag.MAX_STALENESS, str(weights.max_staleness)]
    # The cluster's engine and control-plane keys: `up` puts them in the router's environment.
    argv += [Flag.ENGINE_KEY_ENV, ENGINE_KEY_ENV, Flag.CONTROL_KEYS_ENV, CONTROL_KEYS_ENV]
    argv += [Flag.STATE_FILE, "router-state.json"]  # in its run directory, its cwd
    if prefill or decode:
        argv.append(Flag.PD_DISAGGREGATION)
        for url, bootstrap in prefill:
            argv += [Flag.PREFILL, url, str(bootstrap) if bootstrap is not None else "none"]
        for url in decode:
            argv += [Flag.DECODE, url]
    if regular:
        argv += [Flag.WORKER_URLS, *regular]
    return tuple(argv)


def compact_json(value: object) -> str:
    return json.dumps(value, separators=(",", ":"), sort_keys=True)
