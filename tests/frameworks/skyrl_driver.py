"""skyrl-train 0.3.1's own client code, unmodified, driving a pdctl fleet through its router: run by
.venv-areal's interpreter (scripts/areal-venv.sh), never pdctl's (skyrl-train is no pdctl dependency).

    skyrl_driver.py ROUTER_HOST:PORT RANKS SEED WORKDIR   (no scheme: skyrl-train adds http://)

What skyrl-train's trainer does with remote SGLang engines, in its own calls: the router given as its
one engine of ``tp`` = RANKS (``generator.remote_inference_engine_urls``, ``num_inference_engines: 1``);
``BroadcastTransferStrategy`` makes the group's init info (group "skyrl", ``1 + i*tp*pp`` offsets,
its backend; gloo here, there is no GPU), and rank 0 makes the sender's group while
``InferenceEngineClient.init_weight_update_communicator`` sends the init (``workers/worker.py``
gathers the two); a weight sync is ``reset_prefix_cache()`` made first as a coroutine and awaited
last, with ``send_chunks`` between (one ``{name, dtype, shape}`` call per tensor and the tensor's
broadcast: ``FSDPPolicyWorkerBase.broadcast_to_inference_engines``); rollouts are its batched
``generate``; ``teardown`` destroys the group (a bodyless call). The trainer's weights are pdctl's
sim model of SEED in float32 (``generator.model_dtype``). Writes ``WORKDIR/result.json``.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import skyrl_compat  # noqa: F401  (before skyrl_train: ray's moved class)
import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from skyrl_train.inference_engines.inference_engine_client import InferenceEngineClient
from skyrl_train.inference_engines.remote_inference_engine import create_remote_inference_engines
from skyrl_train.inference_engines.utils import get_sampling_params_for_backend
from skyrl_train.weight_sync import BroadcastTransferStrategy, WeightChunk

from pdctl.sim.model import resolve_model


class ByteTokenizer:
    """The sim's byte vocabulary as the tokenizer skyrl-train decodes responses with."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(i for i in ids if i < 256).decode(errors="replace")


def config(ranks: int) -> OmegaConf:
    return OmegaConf.create(
        {
            "trainer": {"policy": {"model": {"path": "sim://tiny"}}},
            "generator": {
                "backend": "sglang",
                "enable_http_endpoint": False,
                "http_endpoint_host": "127.0.0.1",
                "http_endpoint_port": 8000,
                "num_inference_engines": 1,
                "inference_engine_tensor_parallel_size": ranks,
                "inference_engine_pipeline_parallel_size": 1,
                "inference_engine_data_parallel_size": 1,
                "weight_sync_backend": "gloo",
                "model_dtype": "float32",
                "override_existing_update_group": "disable",
                "sampling_params": {
                    "max_generate_length": 24,
                    "repetition_penalty": 1.0,
                    "temperature": 0.0,
                    "top_p": 1.0,
                    "min_p": 0.0,
                    "top_k": -1,
                    "logprobs": None,
                    "stop": None,
                },
            },
        }
    )


async def main() -> None:
    addr, ranks, seed, work = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    cfg = config(ranks)
    # the trainer's own world (skyrl-train's workers: rank 0 of one here), which send_chunks asks its rank of
    dist.init_process_group("gloo", init_method=f"file://{work / 'trainer-world'}", rank=0, world_size=1)
    engines = create_remote_inference_engines(
        urls=[addr], model_name="sim://tiny", engine_backend="sglang", tokenizer=ByteTokenizer(),
        tensor_parallel_size=ranks, pipeline_parallel_size=1, data_parallel_size=1, expert_parallel_size=1,
    )  # fmt: skip
    client = InferenceEngineClient(engines, ByteTokenizer(), cfg)
    init_info = BroadcastTransferStrategy.create_init_info(cfg)
    sender, _ = await asyncio.gather(
        asyncio.to_thread(BroadcastTransferStrategy.create_sender, init_info, client),
        client.init_weight_update_communicator(init_info),
    )
    result: dict = {"group_name": init_info.group_name, "world_size": init_info.world_size}

    model = resolve_model(f"sim://tiny?seed={seed}", "auto", None)
    chunks = [
        WeightChunk(names=[name], dtypes=[str(torch.float32)], shapes=[list(p.shape)], tensors=[p.detach().float()])
        for name, p in model.named_parameters()
    ]
    cache_reset_task = client.reset_prefix_cache()  # a coroutine, not a task: sent after the updates
    await sender.send_chunks(chunks)
    result["flush"] = await cache_reset_task
    result["tensors"] = len(chunks)

    sampling = get_sampling_params_for_backend("sglang", cfg.generator.sampling_params)
    prompts = [list(b"skyrl rollout one"), list(b"skyrl rollout two")]
    out = await client.generate({"prompt_token_ids": prompts, "sampling_params": sampling})
    result["rollouts"] = [[p, ids] for p, ids in zip(prompts, out["response_ids"], strict=True)]
    result["stop_reasons"] = out["stop_reasons"]
    await client.teardown()
    (work / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    asyncio.run(main())
