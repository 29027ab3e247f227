"""The sim engine's settings: SGLang's flags as ``args.py`` parsed them, plus the sim's own."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdctl.gpu_profiles import SimProfile
    from pdctl.sim.multinode import NodeLayout

log = logging.getLogger("pdctl.sim.remote_instance")

DEFAULT_BOOTSTRAP_PORT = 8998
# The sim's bounds on one request (SGLang 0.5.23 has none): the router's --max-n and
# --max-sequences-per-request defaults, and prompt tokens over all sequences.
DEFAULT_MAX_N = 1024
DEFAULT_MAX_SEQUENCES_PER_REQUEST = 65536
DEFAULT_MAX_REQUEST_TOKENS = 8 * 1024 * 1024


@dataclass(frozen=True)
class RemoteSource:
    """A receiver's ``--remote-instance-weight-loader-*`` settings."""

    seed_ip: str
    service_port: int
    ports: tuple[int, ...]

    @classmethod
    def from_args(cls, args: Any) -> RemoteSource | None:
        """The settings when ``--load-format remote_instance`` is complete; else None, after
        SGLang's warning (``model_path_hook.py``: it falls back to loading from disk)."""
        if args.load_format != "remote_instance":
            return None
        backend = args.remote_instance_weight_loader_backend or "nccl"
        ip = args.remote_instance_weight_loader_seed_instance_ip
        port = args.remote_instance_weight_loader_seed_instance_service_port
        ports = args.remote_instance_weight_loader_send_weights_group_ports
        if backend != "nccl":
            log.warning("Fallback load_format to 'auto' due to '%s' backend is not supported.", backend)
            return None
        if not ip or port is None:
            log.warning("Fallback load_format to 'auto' due to incomplete remote instance weight loader settings.")
            return None
        if not ports:
            log.warning(
                "Fallback load_format to 'auto' due to incomplete remote instance weight loader NCCL group "
                "ports settings."
            )
            return None
        return cls(str(ip), int(port), tuple(int(p) for p in ports))


@dataclass(frozen=True)
class SimConfig:
    """Everything one sim engine is started with: SGLang's flags as ``args.py`` parsed them, plus the sim's own
    ``--sim-*`` settings. Frozen: a running engine's current state (its role, its weight version) lives on SimService
    and Engine, not here."""

    model_path: str
    host: str = "127.0.0.1"
    port: int = 30000
    served_model_name: str | None = None
    tokenizer_path: str | None = None
    tp_size: int = 1
    disaggregation_mode: str = "null"
    """The role it starts in (the service's ``mode`` is the current one)."""
    enable_pd_role_switch: bool = False
    bootstrap_port: int = DEFAULT_BOOTSTRAP_PORT
    load_format: str = "auto"
    remote_source: RemoteSource | None = None
    """``--load-format remote_instance`` with complete settings: the weights come from a seed engine."""
    random_seed: int = 0
    weight_version: str = "default"
    enable_metrics: bool = False
    api_key: str | None = None
    skip_server_warmup: bool = False
    context_length: int | None = None
    max_running_requests: int = 64
    stream_interval: int = 1
    """``--stream-interval``: a stream's tokens per update after its first (SGLang's default 1)."""
    max_queued_requests: int | None = None
    """SGLang: beyond this many waiting requests new ones get 503; ignored in PD modes."""
    prefill_ms_per_token: float = 0.0
    decode_ms_per_step: float = 0.0
    weight_digest: str = "full"
    """How TP ranks compare a weight update (``--sim-weight-digest``; sim/weights.py ``Digest``)."""
    weight_group_timeout_secs: float = 300.0
    """``--sim-weight-group-timeout-secs``: a weight group's collectives' timeout."""
    disk_load_ms: float = 0.0
    """``--sim-disk-load-ms``: added to each load from disk, before the model is touched."""
    profile: SimProfile | None = None
    """``--sim-profile``: the GPU cost model the engine follows (pdctl.sim.costed); None: the plain sim."""
    null: bool = False
    """``--sim-null``: the null engine (pdctl.sim.null) on this engine's port, role and key."""
    prefix_cache: bool = True
    """A profile engine's prefix cache (off: ``--disable-radix-cache``)."""
    max_n: int = DEFAULT_MAX_N
    """``--sim-max-n``: the largest ``n`` a request may ask for (400 above)."""
    max_sequences_per_request: int = DEFAULT_MAX_SEQUENCES_PER_REQUEST
    """``--sim-max-sequences-per-request``: prompts x n of one request."""
    max_request_tokens: int = DEFAULT_MAX_REQUEST_TOKENS
    """``--sim-max-request-tokens``: prompt tokens over all sequences of one request."""
    layout: NodeLayout | None = None
    """Node rank 0 of a multi-node engine (multinode.py); None on one node."""
    dist_timeout_secs: float = 600.0
    server_args: tuple[tuple[str, Any], ...] = ()
    """Every parsed flag, reported by /server_info."""
    launch_command: str = ""
    log_level: str = "INFO"
    torch_threads: int = 1
    """Process settings: applied by ``python -m pdctl.sim``'s main, not by the server."""
    port_file: str | None = None
    forward_hooks: tuple[dict[str, Any], ...] = ()
    """``--forward-hooks``: registered on the model at load (pdctl.sim.hooks)."""
    enable_return_hidden_states: bool = False
    """``--enable-return-hidden-states``: requests may ask for ``return_hidden_states``."""
    """``--sim-port-file``: where the bound ports are written once the engine serves."""
    ignored_flags: tuple[str, ...] = ()
    """SGLang flags accepted but without effect on CPU (logged at start)."""

    @property
    def served_name(self) -> str:
        """The model name the engine reports: ``--served-model-name``, else ``--model-path``."""
        return self.served_model_name or self.model_path
