"""Per-phase memory measurement: MemTracker on CPU, the caching allocator's stats on CUDA.

``PhaseMeter.phase`` names the phase the step is in (``forward``, ``backward``,
``optimizer``; ``None`` outside the measured steps). On CPU a MemTracker subclass
(under FSDP2 an FSDPMemTracker that keeps FSDP2's group hooks, memplan.train.fsdp_meter) sees
every tensor storage the step allocates and keeps, per phase, the highest total and the
per-category bytes at that moment. On CUDA the peak counters are reset at each phase change and
read at the next (``max_memory_allocated`` / ``max_memory_reserved``).

With CPU offload on a CPU-only machine there is one device for both sides, so the bytes of
what FSDP2 keeps on the host (sharded parameters and gradients, optimizer states and the
optimizer step's tensors) are subtracted from the totals: what remains is what an
accelerator would hold.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from memplan.train import quant

HOST_CATEGORIES = ("Sharded Param", "Sharded Grad", "OptState")


@dataclass
class PhasePeak:
    allocated: int = 0
    reserved: int | None = None
    categories: dict[str, int] = field(default_factory=dict)


def _category(key: object) -> str:
    return str(getattr(key, "value", key))


def _tracker_class(base: type) -> type:
    class _PhaseTracker(base):  # type: ignore[misc, valid-type]
        meter: PhaseMeter

        def _pre_fw_hook(self, module, inputs) -> None:  # noqa: ANN001
            # a top-level module called again in one step is the next micro-batch (gradient
            # accumulation, pipeline schedules): restart its per-module stats instead of
            # refusing (MemTracker tracks one call per iteration); totals are unaffected
            if module in self.memory_tracking and not self._mod_tracker.is_bw:
                name = self._mod_tracker.get_known_fqn(module)
                if set(self._mod_tracker.parents) - {name} == {"Global"}:
                    del self.memory_tracking[module]
            super()._pre_fw_hook(module, inputs)

        def _update_peak_stats(self, peak_state) -> None:  # noqa: ANN001
            super()._update_peak_stats(peak_state)
            self.meter._observe(self._curr_mem_snap)

    return _PhaseTracker


class _NoHook:
    """Stands for a gradient hook MemTracker would register (it removes its hooks on exit)."""

    def remove(self) -> None:
        pass


def _skip_frozen(tracker, model: nn.Module) -> None:  # noqa: ANN001 - a MemTracker
    """MemTracker hooks every parameter's gradient, which a frozen one (LoRA's base) refuses:
    mark those as hooked already (tests/accuracy/peft_steps.py does the same)."""
    for param in model.parameters():
        if not param.requires_grad:
            tracker._param_to_grad_hook_handles[param] = (_NoHook(), _NoHook())


class _FiredGradHooks:
    """Frees each step's autograd graph once its backward is done, as a run without the tracker does.

    MemTracker's ModTracker registers an ``all``-mode ``register_multi_grad_hook`` on each module's
    inputs and drops the handle. Such a hook closes over the inputs' ``grad_fn`` nodes and is stored
    on those same nodes: a cycle through autograd's C++ nodes that Python's gc cannot see, so every
    step's graph outlives its backward (measured on the tiny Llama over an int8 base: 25 more
    ``MatMul8bitFp`` nodes alive after each step, none collectable; removing these hooks after the
    backward leaves none). The backward releases what ops save for it anyway, but not what an
    autograd Function keeps as a ``ctx`` attribute: LLM.int8's input (bitsandbytes
    ``MatMul8bitFp``: ``ctx.A = A``), 16 MB of the optimizer phase after three steps there
    (-69% against the model); and, under checkpointing with a frozen embedding (LoRA), the graph's
    input leaf (the embedding output made to require grad) with its ``.grad``, one ``b x s x h``
    pair per step, which an earlier correction emptied by hand. While the meter runs, this records
    those handles and removes each whose hook has fired (its module's backward has run; an ``all``
    hook fires once per graph). tests/validate/test_meter_independent.py holds the result to a count
    that registers no hook at all, on every kind of plan, to the byte."""

    def __init__(self) -> None:
        self._fired: list = []
        self._original = None

    def __enter__(self) -> None:
        from torch.distributed._tools import mod_tracker

        original = self._original = mod_tracker.register_multi_grad_hook
        fired = self._fired

        def register(tensors, fn, *, mode="all"):  # noqa: ANN001, ANN202 - torch's signature
            if mode != "all":
                return original(tensors, fn, mode=mode)
            handle = None

            def hook(grads) -> None:  # noqa: ANN001
                fn(grads)
                fired.append(handle)

            handle = original(tensors, hook, mode=mode)
            return handle

        mod_tracker.register_multi_grad_hook = register

    def __exit__(self, *exc: object) -> None:
        from torch.distributed._tools import mod_tracker

        mod_tracker.register_multi_grad_hook = self._original
        self.release()

    def release(self) -> None:
        """Remove the fired hooks: their graphs die with the last tensor that holds them."""
        while self._fired:
            self._fired.pop().remove()


class PhaseMeter:
    """Context manager measuring per-phase peaks of one rank's training steps."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        fsdp: bool,
        offloaded: bool,
        limit: int | None = None,
    ) -> None:
        self.device = device
        self.offloaded = offloaded
        self.phase: str | None = None
        self.limit = limit  # simulated device capacity (bytes)
        self.label: str | None = None  # the phase the step is in, measured or not
        self.steps = 0  # steps ended (end_step): the one running is steps + 1, warm-up steps included
        # where an exception (an out-of-memory) left the steps: (phase, step number from 1); None: outside them
        self.failed_in: tuple[str, int] | None = None
        self.peaks: dict[str, PhasePeak] = {}
        self._tracker = None
        self._hooks = _FiredGradHooks()
        if device.type == "cpu":
            if fsdp:
                from memplan.train.fsdp_meter import GroupedFSDPMemTracker

                self._tracker = _tracker_class(GroupedFSDPMemTracker)(model, optimizer)
            else:
                from torch.distributed._tools.mem_tracker import MemTracker

                self._tracker = _tracker_class(MemTracker)()
                _skip_frozen(self._tracker, model)
                # a quantized base's scales are neither parameters nor buffers (memplan.train.quant)
                self._tracker.track_external(model, optimizer, *quant.state_tensors(model))
            self._tracker.meter = self

    # -- CPU: called by the tracker on every allocation -----------------------------------
    def _observe(self, snap: dict) -> None:
        if self.phase is None and self.limit is None:
            return
        dev = snap.get(self.device)
        if not dev:
            return
        cats = {_category(k): v for k, v in dev.items()}
        total = cats.get("Total", 0)
        if self.offloaded:
            total -= sum(cats.get(c, 0) for c in HOST_CATEGORIES)
        if self.limit is not None and total > self.limit:
            from memplan.train.runner import SimulatedOutOfMemory

            raise SimulatedOutOfMemory(total, self.limit)
        if self.phase is None:
            return
        peak = self.peaks.setdefault(self.phase, PhasePeak())
        if total > peak.allocated:
            peak.allocated = total
            peak.categories = {k: v for k, v in cats.items() if k != "Total" and v}

    # -- phase changes -------------------------------------------------------------------
    def set_phase(self, phase: str | None, record: bool = True) -> None:
        """Enter ``phase``; its peak is recorded only when ``record`` (the measured steps)."""
        if self.device.type == "cuda":
            self._close_cuda_phase()
            torch.cuda.reset_peak_memory_stats(self.device)
        self._hooks.release()
        self.label = phase
        self.phase = phase if record else None

    def _close_cuda_phase(self) -> None:
        if self.phase is None:
            return
        torch.cuda.synchronize(self.device)
        peak = self.peaks.setdefault(self.phase, PhasePeak())
        allocated = torch.cuda.max_memory_allocated(self.device)
        reserved = torch.cuda.max_memory_reserved(self.device)
        peak.allocated = max(peak.allocated, allocated)
        peak.reserved = max(peak.reserved or 0, reserved)

    def end_step(self) -> None:
        """MemTracker keeps per-module stats of one iteration only."""
        self.steps += 1
        if self._tracker is not None:
            self._tracker.reset_mod_stats()

    def __enter__(self) -> PhaseMeter:
        if self._tracker is not None:
            self._hooks.__enter__()
            try:
                self._tracker.__enter__()
            except BaseException:
                self._hooks.__exit__()  # torch's register_multi_grad_hook restored
                raise
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is not None and self.label is not None:  # kept: leaving clears the label
            self.failed_in = (self.label, self.steps + 1)
        self.set_phase(None)
        if self._tracker is not None:
            self._tracker.__exit__(*exc)
            self._hooks.__exit__(*exc)

    def current_bytes(self) -> int:
        """Bytes allocated now (for out-of-memory reports)."""
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        if self._tracker is None:
            return 0
        snap = self._tracker._curr_mem_snap.get(self.device, {})
        return int(sum(v for k, v in snap.items() if _category(k) == "Total"))
