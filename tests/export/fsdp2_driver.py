"""Run exported FSDP2 modules on a small transformers Llama, one rank under the fake process group.

``python fsdp2_driver.py SNIPPET.py ...`` prints one JSON line per snippet: what the plan made of
the model (FSDP2 groups, DTensor meshes, checkpoint wrappers, DDP, the optimizer class) after a
training step (every micro-batch's forward and backward, then the optimizer step) ran.
"""

from __future__ import annotations

import importlib.util
import json
import sys

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from transformers import LlamaConfig, LlamaForCausalLM

SHAPE = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128)
VOCAB = 256


def _load(path: str):
    spec = importlib.util.spec_from_file_location("plan_snippet", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _fake_allreduce(state: object, bucket: dist.GradBucket) -> torch.futures.Future:
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


# DDP checks the hook's annotations as objects (this module's are strings under __future__)
_fake_allreduce.__annotations__ = {
    "state": object,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}


def run(path: str) -> dict:
    m = _load(path)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=m.WORLD_SIZE)
    try:
        cfg = LlamaConfig(**SHAPE, vocab_size=VOCAB, max_position_embeddings=128)
        cfg._attn_implementation = m.ATTN_IMPLEMENTATION
        model = LlamaForCausalLM(cfg)
        mesh = m.build_mesh("cpu")
        model = m.apply_plan(model, mesh)
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            # the fake process group's futures carry no value: hand each bucket back as reduced
            model.register_comm_hook(None, _fake_allreduce)
        opt = m.build_optimizer(model, mesh, lr=1e-3, momentum=0.9)
        ids = torch.randint(0, VOCAB, (m.MICRO_BATCH, m.SEQ_LEN))
        for _ in range(m.GRADIENT_ACCUMULATION):
            with m.autocast("cpu"):
                logits = model(input_ids=ids).logits
            with m.loss_context():
                m.loss_fn(logits, ids).backward()
        opt.step()
        opt.zero_grad()
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor

        inner = model.module if hasattr(model, "module") else model
        layers = inner.model.layers
        layer = layers[-1]
        gate = (layer._checkpoint_wrapped_module if hasattr(layer, "_checkpoint_wrapped_module") else layer).mlp
        weight = gate.gate_proj.weight
        return {
            "wrapper": type(model).__name__,
            "fsdp_layers": sum(isinstance(x, FSDPModule) for x in layers),
            "checkpointed": sum(hasattr(x, "_checkpoint_wrapped_module") for x in layers),
            "mesh": list(weight.device_mesh.mesh_dim_names) if isinstance(weight, DTensor) else None,
            "param_dtype": str(weight.dtype),
            "optimizer": type(opt).__name__,
            "inner_optimizer": type(getattr(opt, "optim", opt)).__name__,
        }
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    for snippet in sys.argv[1:]:
        print(json.dumps(run(snippet)), flush=True)
