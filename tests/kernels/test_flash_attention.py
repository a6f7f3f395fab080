"""memplan.kernels: FlashAttention forward and backward against an fp32 reference.

The tests marked ``kernels`` run the Triton kernels: on CUDA where there is a GPU, else on CPU
under Triton's interpreter. ``triton.jit`` picks the interpreter when a kernel is defined, and
the Triton library's own helpers when it is imported, so ``TRITON_INTERPRET=1`` must be set
before anything in the process imports Triton (in a full run, collecting other tests imports it
through ``torch._dynamo``). Hence, without a GPU and without ``TRITON_INTERPRET=1`` set at
start, those tests are skipped here and ``test_kernel_tests_under_triton_interpreter`` runs them
in a fresh pytest process that has it; nothing in this process sets the variable. To run them
one by one: ``TRITON_INTERPRET=1 python -m pytest tests/kernels``.

The ``gpu`` class adds larger shapes, peak memory and torch.compile on CUDA.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn.functional as F

from memplan import kernels as mk

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: through the interpreter
KERNELS_HERE = torch.cuda.is_available() or mk.kernel_available(torch.empty(0))


def needs_kernels(test):
    """Marks a test that runs the kernels; skipped where they cannot run in this process."""
    skip = pytest.mark.skipif(not KERNELS_HERE, reason="no GPU: run by test_kernel_tests_under_triton_interpreter")
    return skip(pytest.mark.kernels(test))


DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# max |kernel - fp32 reference| / max(|reference|, 1). fp32 computes exactly (IEEE dots); the
# 16-bit types round P and dS to the input dtype before their matmuls, as FlashAttention-2 does,
# and round the results. Largest errors seen under the interpreter: fp32 6e-7, fp16 5e-4, bf16
# 1e-2 (bf16 has 8 bits of mantissa to fp16's 11)
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
TOL_LSE = 1e-5  # lse comes from exact products of the inputs, summed in fp32

# (batch, q_heads, kv_heads, seq, head_dim): ragged lengths next to the interpreter's 16/32 blocks
SHAPES = [
    pytest.param(2, 2, 2, 64, 32, id="mha-b2-s64-d32"),
    pytest.param(1, 4, 2, 17, 16, id="gqa-s17-d16"),
    pytest.param(1, 4, 1, 100, 64, id="mqa-s100-d64", marks=pytest.mark.slow),  # 10 s interpreted; GQA above
    pytest.param(1, 2, 2, 33, 24, id="mha-s33-d24-padded"),
    pytest.param(1, 2, 1, 1, 32, id="mqa-s1"),
]


def make_qkv(b, hq, hkv, s, d, dtype, device=DEVICE, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rand(h):
        return torch.randn(b, h, s, d, generator=gen).to(device=device, dtype=dtype).requires_grad_()

    return rand(hq), rand(hkv), rand(hkv)


def reference(q, k, v, do, causal, softmax_scale=None):
    """fp32 out, lse and input gradients of the plain-math reference."""
    qr, kr, vr = (t.detach().float().requires_grad_() for t in (q, k, v))
    out, lse = mk.flash_attention_reference(qr, kr, vr, causal, softmax_scale)
    out.backward(do.float())
    return out.detach(), lse.detach(), qr.grad, kr.grad, vr.grad


def assert_close(actual, expected, tol, what):
    err = (actual.detach().float() - expected).abs().max().item()
    scale = max(expected.abs().max().item(), 1.0)
    assert err <= tol * scale, f"{what}: max error {err:.3g} > {tol} x {scale:.3g}"


def check_against_reference(q, k, v, causal, softmax_scale=None, tol=None):
    tol = tol or TOL[q.dtype]
    out, lse = mk.flash_attention_with_lse(q, k, v, causal, softmax_scale, backend="triton")
    assert out.shape == q.shape and out.dtype == q.dtype and lse.dtype == torch.float32
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(q.device, q.dtype)
    out.backward(do)
    ref_out, ref_lse, ref_dq, ref_dk, ref_dv = reference(q, k, v, do, causal, softmax_scale)
    assert_close(out, ref_out, tol, "out")
    assert_close(lse, ref_lse, TOL_LSE, "lse")
    assert_close(q.grad, ref_dq, tol, "dq")
    assert_close(k.grad, ref_dk, tol, "dk")
    assert_close(v.grad, ref_dv, tol, "dv")


# ---------------------------------------------------------------------------------------------
# correctness (interpreter on CPU, or the GPU)
# ---------------------------------------------------------------------------------------------


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t).removeprefix("torch."))
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("b,hq,hkv,s,d", SHAPES)
def test_forward_and_grads_match_fp32_reference(b, hq, hkv, s, d, causal, dtype):
    check_against_reference(*make_qkv(b, hq, hkv, s, d, dtype), causal)


@needs_kernels
def test_softmax_scale_argument():
    check_against_reference(*make_qkv(1, 2, 1, 40, 32, torch.float16), True, softmax_scale=0.3)


@needs_kernels
def test_lse_is_logsumexp_of_the_scaled_scores():
    q, k, v = make_qkv(1, 4, 2, 50, 32, torch.bfloat16)
    _, lse = mk.flash_attention_with_lse(q, k, v, causal=True, backend="triton")
    scores = q.float() @ k.float().repeat_interleave(2, dim=1).transpose(-1, -2) / 32**0.5
    scores = scores.masked_fill(torch.ones(50, 50, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    assert_close(lse, torch.logsumexp(scores, dim=-1), TOL_LSE, "lse")


@needs_kernels
def test_trainer_layout_and_expanded_gradient():
    """The trainer's q/k/v are (b, s, h, d) projections transposed to (b, h, s, d): out keeps that
    layout (so out.transpose(1, 2).reshape(b, s, -1) is a view); out.sum() sends an expanded dO."""
    gen = torch.Generator().manual_seed(2)
    q, k, v = (
        torch.randn(2, 37, h, 32, generator=gen).to(DEVICE, torch.bfloat16).transpose(1, 2).requires_grad_()
        for h in (4, 2, 2)
    )
    out = mk.flash_attention(q, k, v, causal=True, backend="triton")
    assert out.stride() == q.stride()
    out.sum().backward()
    ref_out, _, ref_dq, ref_dk, ref_dv = reference(q, k, v, torch.ones_like(out), causal=True)
    for name, got, want in (
        ("out", out, ref_out),
        ("dq", q.grad, ref_dq),
        ("dk", k.grad, ref_dk),
        ("dv", v.grad, ref_dv),
    ):
        assert_close(got, want, TOL[torch.bfloat16], name)


@needs_kernels
def test_autocast_casts_inputs_like_sdpa():
    """The trainer's bf16-mixed step: fp32 q and k (RoPE'd against fp32 tables) beside a bf16 v."""
    q, k, _ = make_qkv(1, 4, 2, 24, 16, torch.float32)
    v = make_qkv(1, 4, 2, 24, 16, torch.bfloat16)[2]
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        out = mk.flash_attention(q, k, v, backend="triton")
    expected = mk.flash_attention(q.detach().bfloat16(), k.detach().bfloat16(), v.detach(), backend="triton")
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected)
    out.float().sum().backward()
    assert (q.grad.dtype, k.grad.dtype, v.grad.dtype) == (torch.float32, torch.float32, torch.bfloat16)


@needs_kernels
def test_gradient_flows_through_lse():
    q, k, v = make_qkv(1, 4, 2, 30, 16, torch.float32)
    out, lse = mk.flash_attention_with_lse(q, k, v, causal=True, backend="triton")
    (0.5 * out.sum() + lse.sum()).backward()
    qr, kr, vr = (t.detach().clone().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse = mk.flash_attention_reference(qr, kr, vr, causal=True)
    (0.5 * ref_out.sum() + ref_lse.sum()).backward()
    for name, got, want in (("dq", q.grad, qr.grad), ("dk", k.grad, kr.grad), ("dv", v.grad, vr.grad)):
        assert_close(got, want, TOL[torch.float32], name)


# ---------------------------------------------------------------------------------------------
# memory: the forward keeps out and lse for the backward, never an s x s tensor
# ---------------------------------------------------------------------------------------------


@needs_kernels
def test_saved_for_backward_is_inputs_out_and_lse():
    b, hq, hkv, s, d = 1, 4, 2, 100, 16
    q, k, v = make_qkv(b, hq, hkv, s, d, torch.bfloat16)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out, lse = mk.flash_attention_with_lse(q, k, v, causal=True, backend="triton")
    assert [tuple(t.shape) for t in saved] == [(b, hq, s, d), (b, hkv, s, d), (b, hkv, s, d), (b, hq, s, d), (b, hq, s)]
    # the very tensors, not copies: nothing is kept beyond what the caller already holds
    assert [t.data_ptr() for t in saved] == [t.data_ptr() for t in (q, k, v, out, lse)]
    assert lse.dtype == torch.float32
    assert all(t.numel() < b * hq * s * s for t in saved), "an s x s tensor was saved"


# recomputation: the trainer's save lists name the kernel's op as the dispatcher sees it
# ---------------------------------------------------------------------------------------------


def _kernel_ops_in_backward(policy, q, k, v):
    """Attention between two matmuls, checkpointed under one of the trainer's save-list
    policies; returns the gradients and how often each memplan op ran during the backward."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    from memplan.train.model import op_name

    class CountOps(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ran = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ran[op_name(func)] += 1
            return func(*args, **(kwargs or {}))

    w = torch.eye(q.shape[-1], dtype=q.dtype, device=q.device).requires_grad_()

    def block(q, k, v, w):
        return mk.flash_attention(q @ w, k, v, causal=True, backend="triton") @ w

    out = checkpoint(
        block, q, k, v, w, use_reentrant=False, context_fn=lambda: create_selective_checkpoint_contexts(policy)
    )
    with CountOps() as counted:
        out.sum().backward()
    return [t.grad for t in (q, k, v, w)], counted.ran


@needs_kernels
@pytest.mark.parametrize(("recompute", "forwards_again"), [("selective-op", 0), ("selective", 1)])
def test_recompute_policies_name_the_kernel_op(recompute, forwards_again):
    """The trainer's save lists match the kernel's op by the name the dispatcher gives it:
    selective-op saves the kernel's output (its forward does not run again in the backward),
    selective recomputes it (once). Both give the gradients of the plain run."""
    from collections import defaultdict

    from memplan.train.model import _selective_policy
    from memplan.train.parallel import op_sac_policy

    policy = op_sac_policy(defaultdict(int)) if recompute == "selective-op" else _selective_policy
    q, k, v = make_qkv(1, 4, 2, 40, 16, torch.float32)
    grads, ran = _kernel_ops_in_backward(policy, q, k, v)
    assert ran["flash_attention_forward"] == forwards_again and ran["flash_attention_backward"] == 1
    for t in (q, k, v):
        t.grad = None
    w = torch.eye(16, dtype=q.dtype, device=q.device).requires_grad_()
    (mk.flash_attention(q @ w, k, v, causal=True, backend="triton") @ w).sum().backward()
    for got, want in zip(grads, [q.grad, k.grad, v.grad, w.grad], strict=True):
        torch.testing.assert_close(got, want)


# ---------------------------------------------------------------------------------------------
# bad input: ValueError before any launch, the same on every backend
# ---------------------------------------------------------------------------------------------


def _qkv(q_shape=(1, 4, 8, 16), kv_shape=(1, 2, 8, 16), dtype=torch.float16, k_dtype=None, device=DEVICE):
    return (
        torch.randn(q_shape, device=device).to(dtype),
        torch.randn(kv_shape, device=device).to(k_dtype or dtype),
        torch.randn(kv_shape, device=device).to(k_dtype or dtype),
    )


def _transposed_last_dim():
    q, k, v = _qkv()
    return torch.randn(1, 4, 16, 8, device=q.device).to(torch.float16).transpose(-1, -2), k, v


BAD_INPUTS = [
    pytest.param(lambda: _qkv(dtype=torch.int32), "dtype", id="int-dtype"),
    pytest.param(lambda: _qkv(dtype=torch.float64), "dtype", id="fp64"),
    pytest.param(lambda: _qkv(k_dtype=torch.bfloat16), "dtypes differ", id="mixed-dtypes"),
    pytest.param(lambda: _qkv(q_shape=(4, 8, 16)), "4-D", id="3-d"),
    pytest.param(lambda: _qkv(kv_shape=(1, 2, 9, 16)), "differ in batch, seq or head_dim", id="seq-mismatch"),
    pytest.param(lambda: _qkv(kv_shape=(2, 2, 8, 16)), "differ in batch, seq or head_dim", id="batch-mismatch"),
    pytest.param(lambda: _qkv(q_shape=(1, 3, 8, 16)), "multiple of k/v heads", id="heads-not-divisible"),
    pytest.param(lambda: _qkv((1, 4, 8, 512), (1, 2, 8, 512)), "head_dim 512 unsupported", id="head-dim-512"),
    pytest.param(lambda: _qkv((1, 4, 8, 0), (1, 2, 8, 0)), "head_dim 0 unsupported", id="head-dim-0"),
    pytest.param(_transposed_last_dim, "contiguous last dim", id="last-dim-strided"),
    pytest.param(
        lambda: (*_qkv()[:2], torch.randn(1, 2, 8, 8, device=DEVICE).half()), "shapes differ", id="k-v-mismatch"
    ),
]


@pytest.fixture
def no_launch(monkeypatch):
    """Fail the test if a kernel is launched (the checks must come first)."""
    kernels = mk.triton_kernels()
    if kernels is not None:

        def launched(kernel):
            pytest.fail(f"{kernel} launched on bad input")

        monkeypatch.setattr(kernels, "wrap_triton", launched)


@pytest.mark.parametrize("make,match", BAD_INPUTS)
@pytest.mark.parametrize("backend", ["auto", "triton", "fallback", "op"])
def test_bad_input_raises_value_error_before_launch(make, match, backend, no_launch):
    q, k, v = (t.to(DEVICE) for t in make())
    with pytest.raises(ValueError, match=match):
        if backend == "op":  # the torch.library op checks too
            torch.ops.memplan.flash_attention_forward(q, k, v, True, 0.25)
        else:
            mk.flash_attention(q, k, v, backend=backend)


def test_backward_op_rejects_mismatched_gradient(no_launch):
    q, k, v = (t.to(DEVICE) for t in _qkv())
    lse = torch.zeros(1, 4, 8, device=DEVICE)
    with pytest.raises(ValueError, match="backward"):
        torch.ops.memplan.flash_attention_backward(q[:, :, :4], q, k, v, q, lse, None, True, 0.25)


def test_unknown_backend():
    with pytest.raises(ValueError, match="backend must be"):
        mk.flash_attention(*(t.to(DEVICE) for t in _qkv()), backend="cudnn")


# ---------------------------------------------------------------------------------------------
# dispatch and fallback
# ---------------------------------------------------------------------------------------------


@needs_kernels
def test_auto_runs_the_kernels_where_available(monkeypatch):
    q, k, v = make_qkv(1, 4, 2, 20, 16, torch.float16)
    assert mk.kernel_available(q)

    def sdpa(*args, **kwargs):
        raise AssertionError("auto fell back to SDPA")

    monkeypatch.setattr(mk, "sdpa_attention", sdpa)
    assert torch.equal(mk.flash_attention(q, k, v), mk.flash_attention(q, k, v, backend="triton"))


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_fallback_is_sdpa(causal, monkeypatch):
    q, k, v = make_qkv(1, 4, 2, 20, 16, torch.float32)

    def kernels(*args, **kwargs):
        raise AssertionError("the fallback ran the Triton kernels")

    if mk.triton_kernels() is not None:
        monkeypatch.setattr(mk.triton_kernels(), "attention_with_lse", kernels)
    out = mk.flash_attention(q, k, v, causal=causal, backend="fallback")
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True))


@pytest.mark.skipif(KERNELS_HERE, reason="the kernel tests ran in this process")
@pytest.mark.parametrize("which", ["not slow", pytest.param("slow", marks=pytest.mark.slow)])
def test_kernel_tests_under_triton_interpreter(which):
    """This file's kernel tests, in a fresh pytest process with TRITON_INTERPRET=1 from its start:
    the default ones, and under ``-m slow`` the slow ones."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    marks = f"kernels and not gpu and {which}"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", marks, __file__]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=os.path.dirname(__file__))
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) > 0 and not re.search(r"skipped|failed|error", summary), summary


def _run(script: str, **env_changes) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(env_changes)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


FALLBACK_SCRIPT = """
    import json, sys
    {block}
    import torch, torch.nn.functional as F
    import memplan.kernels as mk
    imported_triton = sys.modules.get("triton") is not None
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 20, 16, generator=g).requires_grad_() for h in (4, 2, 2))
    out = mk.flash_attention(q, k, v, causal=True)
    out.sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    ref.sum().backward()
    try:
        mk.flash_attention(q, k, v, backend="triton")
        refused = False
    except ValueError:
        refused = True
    print(json.dumps({{
        "imported_triton": imported_triton,
        "available": mk.kernel_available(q),
        "module": mk.triton_kernels() is not None,
        "equal": torch.equal(out, ref) and all(torch.equal(a, t.grad) for a, t in zip(grads, (q, k, v))),
        "refused": refused,
    }}))
"""


@pytest.mark.parametrize("triton_installed", [True, False], ids=["no-interpreter", "no-triton"])
def test_cpu_without_interpreter_falls_back_to_sdpa(triton_installed):
    """A fresh process: CPU tensors without TRITON_INTERPRET, or without Triton at all, get SDPA,
    and importing memplan.kernels does not import Triton."""
    block = "" if triton_installed else "sys.modules['triton'] = None  # as if not installed"
    result = _run(FALLBACK_SCRIPT.format(block=block))
    assert result == {
        "imported_triton": False,
        "available": False,
        "module": triton_installed,
        "equal": True,
        "refused": True,
    }


def test_fake_tensor_trace_of_the_ops():
    """The ops' fake implementations, which torch.compile traces with: fake CUDA tensors (no GPU
    needed) through the compiled (not interpreted) kernels' launchers. out takes q's layout; lse
    is fp32 (b, h, s)."""
    script = """
        import json, torch
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.proxy_tensor import make_fx
        import memplan.kernels as mk
        assert not mk.triton_kernels().INTERPRETED
        with FakeTensorMode():
            q = torch.empty(2, 1000, 8, 128, dtype=torch.bfloat16, device="cuda").transpose(1, 2)
            k = torch.empty(2, 2, 1000, 128, dtype=torch.bfloat16, device="cuda")
            v = torch.empty(2, 2, 1000, 128, dtype=torch.bfloat16, device="cuda")

        def step(q, k, v):
            out, lse = torch.ops.memplan.flash_attention_forward(q, k, v, True, 0.1)
            grads = torch.ops.memplan.flash_attention_backward(out, q, k, v, out, lse, None, True, 0.1)
            return out, lse, *grads

        graph = make_fx(step, tracing_mode="fake")(q, k, v)
        metas = [n.meta["val"] for n in graph.graph.output_node().args[0]]
        print(json.dumps({
            "ops": sorted({str(n.target) for n in graph.graph.nodes if n.op == "call_function"}),
            "shapes": [list(t.shape) for t in metas],
            "dtypes": [str(t.dtype) for t in metas],
            "out_stride": list(metas[0].stride()),
            "devices": sorted({str(t.device) for t in metas}),
        }))
    """
    result = _run(script)
    assert "memplan.flash_attention_forward.default" in result["ops"]
    assert "memplan.flash_attention_backward.default" in result["ops"]
    q, kv = [2, 8, 1000, 128], [2, 2, 1000, 128]
    assert result["shapes"] == [q, [2, 8, 1000], q, kv, kv]
    assert result["dtypes"] == ["torch.bfloat16", "torch.float32"] + ["torch.bfloat16"] * 3
    assert result["out_stride"] == [1000 * 8 * 128, 128, 8 * 128, 1]
    assert result["devices"] == ["cuda:0"]


# ---------------------------------------------------------------------------------------------
# torch.compile guard: versions known not to compile the kernels run the eager op (versions faked)
# ---------------------------------------------------------------------------------------------

KNOWN_BAD = ((2, 11), (3, 6))  # torch 2.11.0+cu130 with Triton 3.6.0 failed to compile _attn_fwd


@pytest.fixture
def fa(monkeypatch):
    """The kernel module, with its one-warning memory cleared."""
    kernels = mk.triton_kernels()
    if kernels is None:
        pytest.skip("needs Triton")
    monkeypatch.setattr(kernels, "_warned", set())
    return kernels


def _fake_versions(monkeypatch, fa, torch_v, triton_v):
    monkeypatch.setattr(fa, "torch_version", lambda: torch_v)
    monkeypatch.setattr(fa, "triton_version", lambda: triton_v)


@pytest.mark.parametrize(
    ("version", "release"),
    [("2.11.0+cu130", (2, 11)), ("3.6.0", (3, 6)), ("2.12.0a0+git1234", (2, 12)), ("3.10.1", (3, 10)), ("3", (3, 0))],
)
def test_compile_guard_reads_release(fa, version, release):
    assert fa._release(version) == release


@pytest.mark.parametrize(
    ("torch_v", "triton_v", "refused"),
    [
        ((2, 11), (3, 6), True),
        ((2, 10), (3, 5), True),
        ((2, 11), (3, 7), False),
        ((2, 12), (3, 6), False),
        ((2, 13), (3, 8), False),
    ],
)
def test_compile_guard_versions(fa, monkeypatch, torch_v, triton_v, refused):
    _fake_versions(monkeypatch, fa, torch_v, triton_v)
    reason = fa.compile_unsupported()
    assert (reason is not None) == refused
    if refused:
        names = f"torch {torch_v[0]}.{torch_v[1]} and Triton {triton_v[0]}.{triton_v[1]}"
        assert names in reason and "\n" not in reason


def _record_ops(monkeypatch, fa):
    """Replaces the op with a recorder; returns the calls' (path, args)."""
    calls = []

    def op(*args):
        calls.append(args)
        return "out", "lse"

    monkeypatch.setattr(fa, "flash_attention_forward", op)
    return calls


def test_compile_guard_eager_calls_unchecked(fa, monkeypatch):
    """Outside torch.compile the versions are never consulted and nothing warns."""
    _fake_versions(monkeypatch, fa, *KNOWN_BAD)
    calls = _record_ops(monkeypatch, fa)
    monkeypatch.setattr(fa, "_eager_forward", lambda *a: pytest.fail("eager fallback taken outside torch.compile"))
    q = torch.empty(1, 2, 4, 16, device=DEVICE)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fa.attention_with_lse(q, q, q, causal=1) == ("out", "lse")
    assert calls == [(q, q, q, True, 0.25)]


def test_compile_guard_known_bad_versions_take_the_eager_op(fa, monkeypatch):
    """Under torch.compile (faked) with torch 2.11 and Triton 3.6: the op behind
    torch.compiler.disable, one warning naming the versions however often it runs."""
    _fake_versions(monkeypatch, fa, *KNOWN_BAD)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    calls = _record_ops(monkeypatch, fa)
    q = torch.empty(1, 2, 4, 16, device=DEVICE)
    with pytest.warns(RuntimeWarning, match=r"torch 2\.11 and Triton 3\.6") as caught:
        for _ in range(3):
            assert fa.attention_with_lse(q, q, q, True, 0.5) == ("out", "lse")
    assert len([w for w in caught if "memplan.kernels" in str(w.message)]) == 1
    assert calls == [(q, q, q, True, 0.5)] * 3


@pytest.mark.parametrize("versions", [((2, 13), (3, 8)), ((2, 12), (3, 6)), ((2, 11), (3, 7))], ids=str)
def test_compile_guard_other_versions_trace_the_op(fa, monkeypatch, versions):
    _fake_versions(monkeypatch, fa, *versions)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    calls = _record_ops(monkeypatch, fa)
    monkeypatch.setattr(fa, "_eager_forward", lambda *a: pytest.fail("eager fallback taken on a version that compiles"))
    q = torch.empty(1, 2, 4, 16, device=DEVICE)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fa.attention_with_lse(q, q, q)
    assert len(calls) == 1


@needs_kernels
def test_torch_compile_on_known_bad_versions_runs_the_eager_op(monkeypatch):
    """A real torch.compile (aot_eager: no Inductor, so it runs on the CPU through the interpreter
    too) of flash_attention with the versions faked to torch 2.11 / Triton 3.6: a graph break around
    the op, one warning, the eager output and gradients."""
    fa = mk.triton_kernels()
    monkeypatch.setattr(fa, "_warned", set())
    _fake_versions(monkeypatch, fa, *KNOWN_BAD)
    torch._dynamo.reset()
    q, k, v = make_qkv(1, 4, 2, 20, 16, torch.float32)
    eager = mk.flash_attention(q, k, v, backend="triton")
    eager.sum().backward()
    eager_grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    with pytest.warns(RuntimeWarning, match=r"torch 2\.11 and Triton 3\.6"):
        out = torch.compile(mk.flash_attention, backend="aot_eager")(q, k, v, backend="triton")
    out.sum().backward()
    torch._dynamo.reset()
    torch.testing.assert_close(out, eager)
    for got, want in zip((q.grad, k.grad, v.grad), eager_grads, strict=True):
        torch.testing.assert_close(got, want)


@needs_kernels
def test_opcheck_schema_and_autograd_registration():
    q, k, v = (t.detach() for t in make_qkv(1, 4, 2, 20, 16, torch.float32))
    # the fake-tensor and AOT checks need compiled kernels (GPU class below)
    utils = ("test_schema", "test_autograd_registration")
    torch.library.opcheck(torch.ops.memplan.flash_attention_forward.default, (q, k, v, True, 0.25), test_utils=utils)


# ---------------------------------------------------------------------------------------------
# autotune configs
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["fwd", "dkdv", "dq"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t).removeprefix("torch."))
@pytest.mark.parametrize("head_dim", [16, 64, 80, 128, 256])
@pytest.mark.parametrize("seq", [1, 100, 4096])
def test_autotune_pruning(kind, dtype, head_dim, seq):
    """The pruner keeps a few configs of the head dim's (or fp32's) set: within the shared-memory
    budget and no longer than the sequence, or else the one of smallest tiles."""
    fa = mk.triton_kernels()
    import triton

    pad = max(16, triton.next_power_of_2(head_dim))
    bucket = "fp32" if dtype == torch.float32 else min(b for b in (64, 128, 256) if b >= pad)
    table = fa._CONFIGS[kind][bucket]
    configs = [
        triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s)
        for m, n, w, s in sorted({c for t in fa._CONFIGS[kind].values() for c in t})
    ]
    args = {"Q": torch.empty(0, dtype=dtype, device=DEVICE), "HEAD_DIM_PAD": pad, "N_CTX": seq}
    kept = fa._pruner(kind)(configs, {}, **args)
    assert 1 <= len(kept) <= len(table) <= 4
    assert all(fa._key(c) in table for c in kept)
    longest = max(16, triton.next_power_of_2(seq))  # blocks round the sequence up to a power of two
    fitting = [c for c in kept if max(fa._key(c)[:2]) <= longest and fa._tile_bytes(c, args, kind) <= 160 * 1024]
    assert fitting == kept or (len(kept) == 1 and not fitting)
    if kind == "dkdv":
        assert all(fa._key(c)[1] % fa._key(c)[0] == 0 for c in kept)  # query blocks tile a key block
    if seq == 4096 and dtype != torch.float32 and head_dim <= 128:
        assert len(kept) >= 3  # long sequences of the usual head dims get a real choice


# ---------------------------------------------------------------------------------------------
# GPU: larger shapes, peak memory, torch.compile (skipped without CUDA)
# ---------------------------------------------------------------------------------------------


def sdpa_error_bound(q, k, v, causal, ref_out, ref_grads, do):
    """2x SDPA's own error in q's dtype (FlashAttention's test criterion) plus a floor."""
    qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])
    out.backward(do)
    got = (out, qs.grad, ks.grad, vs.grad)
    return [2 * (a.float() - r).abs().max().item() + 1e-3 for a, r in zip(got, (ref_out, *ref_grads), strict=True)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
class TestCuda:
    @pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
    @pytest.mark.parametrize(
        "b,hq,hkv,s,d",
        [(2, 8, 2, 1024, 64), (1, 8, 8, 2048, 128), (1, 8, 1, 4000, 128), (1, 4, 2, 3001, 64)],
        ids=["gqa-1k-d64", "mha-2k-d128", "mqa-4000-d128", "gqa-3001-d64"],
    )
    def test_large_shapes_bf16(self, b, hq, hkv, s, d, causal):
        q, k, v = make_qkv(b, hq, hkv, s, d, torch.bfloat16, device="cuda")
        out, lse = mk.flash_attention_with_lse(q, k, v, causal, backend="triton")
        do = torch.randn_like(out)
        out.backward(do)
        ref_out, ref_lse, *ref_grads = reference(q, k, v, do, causal)
        bounds = sdpa_error_bound(q, k, v, causal, ref_out, ref_grads, do)
        for name, got, want, bound in zip(
            ("out", "dq", "dk", "dv"), (out, q.grad, k.grad, v.grad), (ref_out, *ref_grads), bounds, strict=True
        ):
            err = (got.float() - want).abs().max().item()
            assert err <= bound, f"{name}: error {err:.3g} > 2 x SDPA's + 1e-3 = {bound:.3g}"
        assert_close(lse, ref_lse, 1e-4, "lse")

    def test_forward_allocates_only_out_and_lse(self):
        q, k, v = make_qkv(1, 8, 2, 4096, 128, torch.bfloat16, device="cuda")
        mk.flash_attention(q, k, v)  # autotune first: its benchmarking allocates a cache-flush buffer
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out, lse = mk.flash_attention_with_lse(q, k, v)
        torch.cuda.synchronize()
        expected = out.numel() * out.element_size() + lse.numel() * 4
        assert torch.cuda.memory_allocated() - before == expected  # kept for the backward
        assert torch.cuda.max_memory_allocated() - before == expected  # no workspace on the way

    def test_peak_memory_grows_linearly_with_seq(self):
        """Forward + backward peak above the inputs at three equally spaced lengths: equal
        increments (an s x s buffer would make the second 5/3 of the first)."""
        peaks = []
        for s in (4096, 8192, 12288):
            q, k, v = make_qkv(1, 8, 2, s, 128, torch.bfloat16, device="cuda")
            do = torch.randn_like(q)
            mk.flash_attention(q, k, v).backward(do)  # autotune outside the measurement
            q.grad = k.grad = v.grad = None
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            mk.flash_attention(q, k, v).backward(do)
            torch.cuda.synchronize()
            peaks.append(torch.cuda.max_memory_allocated() - before)
            del q, k, v, do
        ratio = (peaks[2] - peaks[1]) / (peaks[1] - peaks[0])
        assert 0.95 <= ratio <= 1.05, f"peaks {peaks}: increment ratio {ratio:.3f}, not linear"

    def test_torch_compile(self, monkeypatch):
        """Inductor compiles the kernels; where this torch and Triton are known not to
        (``compile_unsupported``: torch < 2.12 with Triton < 3.7), flash_attention runs the eager op
        with a warning naming them, and the op called directly is not compiled (it would fail)."""
        fa = mk.triton_kernels()
        monkeypatch.setattr(fa, "_warned", set())
        unsupported = fa.compile_unsupported()
        q, k, v = make_qkv(2, 8, 2, 1000, 64, torch.bfloat16, device="cuda")
        do = torch.randn_like(q)

        def op(q, k, v):
            return torch.ops.memplan.flash_attention_forward(q, k, v, True, 0.125)[0]

        eager = op(q, k, v)
        eager.backward(do)
        eager_grads = [t.grad.clone() for t in (q, k, v)]
        cases = [(mk.flash_attention, {})] if unsupported else [(op, {"fullgraph": True}), (mk.flash_attention, {})]
        for fn, kwargs in cases:
            for t in (q, k, v):
                t.grad = None
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                out = torch.compile(fn, **kwargs)(q, k, v)
            assert [str(w.message) for w in caught if "memplan.kernels" in str(w.message)] == (
                [unsupported] if unsupported else []
            )
            out.backward(do)
            torch.testing.assert_close(out, eager)
            for got, want in zip((q.grad, k.grad, v.grad), eager_grads, strict=True):
                torch.testing.assert_close(got, want)

    def test_opcheck(self):
        q, k, v = (t.detach() for t in make_qkv(1, 4, 2, 300, 64, torch.bfloat16, device="cuda"))
        torch.library.opcheck(torch.ops.memplan.flash_attention_forward.default, (q, k, v, True, 0.125))
