"""Real transformers training steps on CPU, measured with MemTracker.

The loop is the one the ``hf`` runtime profile describes (the transformers course's loop):
``out = model(input_ids=ids, labels=ids); out.loss.backward(); opt.step();
opt.zero_grad(set_to_none=True)``. The steady-state peak is the highest total MemTracker
sees over three steps (the first step allocates the optimizer states lazily).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import transformers
from torch.distributed._tools.mem_tracker import MemTracker

_CLASSES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
}


@dataclass(frozen=True)
class Case:
    name: str
    arch: str = "llama"
    hidden: int = 256
    layers: int = 2
    heads: int = 4
    kv_heads: int = 4
    ffn: int = 688
    vocab: int = 8000
    tied: bool = False
    batch: int = 2
    seq: int = 128
    dtype: str = "float32"
    checkpointing: bool = False
    attention: str = "sdpa"

    def hf_config(self) -> dict:
        """The config.json transformers would write for this case."""
        config_cls, model_cls = _CLASSES[self.arch]
        cfg = config_cls(
            hidden_size=self.hidden, num_hidden_layers=self.layers, num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads, intermediate_size=self.ffn, vocab_size=self.vocab,
            tie_word_embeddings=self.tied, max_position_embeddings=max(self.seq, 256),
        )
        data = cfg.to_dict()
        data["architectures"] = [model_cls.__name__]
        return data


def measure_peak(case: Case, steps: int = 3) -> int:
    """Steady-state peak bytes of a training step, as MemTracker counts them."""
    torch.manual_seed(0)
    config_cls, model_cls = _CLASSES[case.arch]
    config = config_cls(**{k: v for k, v in case.hf_config().items() if k != "architectures"})
    config._attn_implementation = case.attention
    model = model_cls(config).to(getattr(torch, case.dtype))
    if case.checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    ids = torch.randint(0, case.vocab, (case.batch, case.seq))
    tracker = MemTracker()
    tracker.track_external(model, opt)
    with tracker:
        for _ in range(steps):
            out = model(input_ids=ids, labels=ids)
            out.loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            tracker.reset_mod_stats()
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
