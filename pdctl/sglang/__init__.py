"""SGLang's wire contract, in one place.

The planner (flags), the router (PD bodies, endpoints), the sim (the server side) and the
weight push (group and update bodies) import from here; none of them spells an SGLang
endpoint or flag on its own. When SGLang changes, this package changes.
Facts: ../shared/sglang-protocol.md (SGLang 0.5.23, sglang-router 0.3.2).
"""

from pdctl.sglang.flags import (
    OWNED_FLAGS,
    REMOVED_FLAGS,
    FlagInfo,
    ServerFlagTable,
    check_extra_args,
    render_extra_args,
    server_flags,
)
from pdctl.sglang.protocol import (
    DEFAULT_GROUP_NAME,
    FAKE_BOOTSTRAP_HOST,
    MAX_BOOTSTRAP_ROOM,
    SPOKEN_VERSION,
    Endpoint,
    PauseMode,
    batch_size_of,
    destroy_weights_update_group_body,
    generate_error_body,
    init_weights_update_group_body,
    inject_bootstrap,
    openai_error_body,
    openai_stream_error_chunk,
    pause_generation_body,
    supports_flattened_bucket,
    supports_weight_update_session,
    update_weight_version_body,
    update_weights_from_disk_body,
    update_weights_from_distributed_body,
)

__all__ = [
    "DEFAULT_GROUP_NAME",
    "FAKE_BOOTSTRAP_HOST",
    "MAX_BOOTSTRAP_ROOM",
    "OWNED_FLAGS",
    "REMOVED_FLAGS",
    "SPOKEN_VERSION",
    "Endpoint",
    "FlagInfo",
    "PauseMode",
    "ServerFlagTable",
    "batch_size_of",
    "check_extra_args",
    "destroy_weights_update_group_body",
    "generate_error_body",
    "init_weights_update_group_body",
    "inject_bootstrap",
    "openai_error_body",
    "openai_stream_error_chunk",
    "pause_generation_body",
    "render_extra_args",
    "server_flags",
    "supports_flattened_bucket",
    "supports_weight_update_session",
    "update_weight_version_body",
    "update_weights_from_disk_body",
    "update_weights_from_distributed_body",
]
