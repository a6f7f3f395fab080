"""Specs: pydantic models of what memplan reads (model, workload, plan, hardware) and their loaders."""

from memplan.specs.hardware import ClusterSpec, GPUSpec
from memplan.specs.model import ModelSpec, MoESpec
from memplan.specs.plan import Plan
from memplan.specs.workload import InferenceWorkload, TrainingWorkload

__all__ = ["ClusterSpec", "GPUSpec", "InferenceWorkload", "ModelSpec", "MoESpec", "Plan", "TrainingWorkload"]
