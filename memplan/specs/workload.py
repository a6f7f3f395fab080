"""What the GPUs do: a training step or an inference (prefill + decode) batch."""

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt

_MAX_TOKENS = 100_000_000  # longer than any context window in use


class TrainingWorkload(BaseModel):
    """One optimizer step: ``global_batch`` sequences of ``seq_len`` tokens.

    Gradient accumulation is derived: global_batch / (micro_batch x data-parallel degree).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["training"] = "training"
    seq_len: StrictInt = Field(2048, gt=0, le=_MAX_TOKENS, description="Tokens per sequence.")
    micro_batch: StrictInt = Field(1, gt=0, le=1_000_000, description="Sequences per forward/backward on one rank.")
    global_batch: StrictInt | None = Field(
        None, gt=0, le=100_000_000, description="Sequences per optimizer step (default: micro_batch x dp)."
    )


class InferenceWorkload(BaseModel):
    """Serving a batch: a prompt prefilled, then tokens generated with a KV cache."""

    # defer_build: validators built at the first inference estimate, not when a training one imports this
    model_config = ConfigDict(extra="forbid", frozen=True, defer_build=True)

    kind: Literal["inference"] = "inference"
    batch: StrictInt = Field(1, gt=0, le=1_000_000, description="Concurrent sequences.")
    prompt_tokens: StrictInt = Field(2048, gt=0, le=_MAX_TOKENS)
    generated_tokens: StrictInt = Field(256, ge=0, le=_MAX_TOKENS)
    kv_dtype: Literal["fp32", "bf16", "fp16", "fp8", "int8"] = Field("bf16", description="KV-cache element type.")
    block_size: StrictInt | None = Field(
        None, gt=0, le=1_000_000, description="Paged KV cache block size in tokens (vLLM uses 16); None: contiguous."
    )
    prefill_chunk: StrictInt | None = Field(
        None,
        gt=0,
        le=_MAX_TOKENS,
        description="Tokens one prefill forward processes, across the batch (vLLM's max_num_batched_tokens under "
        "chunked prefill); None: every prompt of the batch in one forward (transformers' generate).",
    )

    @property
    def context(self) -> int:
        """Tokens held per sequence at the end: prompt + generated."""
        return self.prompt_tokens + self.generated_tokens


Workload = Annotated[TrainingWorkload | InferenceWorkload, Field(discriminator="kind")]
