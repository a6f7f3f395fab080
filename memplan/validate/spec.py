"""What one validation run is asked to do (pure pydantic: sent to worker processes as JSON)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from memplan.costmodel.memory import gradient_accumulation
from memplan.specs.model import ModelSpec
from memplan.specs.plan import Plan
from memplan.specs.workload import TrainingWorkload


class RunSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: ModelSpec
    workload: TrainingWorkload
    plan: Plan
    steps: int = Field(3, gt=0, description="Measured steps after warm-up.")
    warmup: int = Field(1, ge=1, description="Steps before measuring (optimizer states appear in the first).")
    device: Literal["cpu", "cuda"] = "cpu"
    simulate: bool = Field(True, description="Run one rank alone under the fake process group.")
    rank: int = Field(0, ge=0, description="The rank to run under simulation (the most-loaded one).")
    memory_limit: int | None = Field(None, gt=0, description="Simulated device capacity in bytes (CPU).")
    seed: int = 0
    collective_timeout_s: int = Field(300, gt=0)
    peak_flops: float | None = Field(None, description="The device's dense peak FLOP/s, for MFU.")
    flops_per_step: float = Field(0.0, ge=0, description="Model FLOPs of one step on this rank, for MFU.")
    alloc_conf: str | None = Field(
        None, description="PYTORCH_CUDA_ALLOC_CONF the ranks run with (None: the environment's)."
    )

    @property
    def accumulation(self) -> int:
        return gradient_accumulation(self.workload, self.plan)

    def stage_of(self, rank: int) -> int:
        """Pipeline stage of a global rank in the (pp, dp, tp) mesh."""
        return rank // (self.plan.dp * self.plan.tp)

    def record_fields(self, rank: int | None = None, simulated: bool | None = None) -> dict:
        """What every RunRecord of this run says about the run itself, whatever its outcome."""
        rank = self.rank if rank is None else rank
        return dict(
            model=self.model.model_dump(mode="json"),
            workload=self.workload.model_dump(mode="json"),
            plan=self.plan.model_dump(mode="json"),
            device=self.device,
            simulated=self.simulate and self.plan.world_size > 1 if simulated is None else simulated,
            world_size=self.plan.world_size,
            rank=rank,
            stage=self.stage_of(rank),
            steps=self.steps,
            warmup=self.warmup,
        )
