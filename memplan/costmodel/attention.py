"""Which kernel ``torch.nn.functional.scaled_dot_product_attention`` runs, and what it keeps for backward.

A model of PyTorch's SDPA dispatch for torch 2.6 through 2.13, standard library only (no torch
import). Sources, all in pytorch/pytorch:

- ``aten/src/ATen/native/transformers/attention.cpp``: ``scaled_dot_product_attention`` (calls the
  device's ``_fused_sdp_choice`` and then the chosen op) and ``_scaled_dot_product_attention_math``
  (the composite "math" path).
- ``aten/src/ATen/native/transformers/sdp_utils_cpp.cpp``: ``select_sdp_backend_cpp`` (CPU: flash,
  then math) and ``use_flash_attention_cpp``.
- ``aten/src/ATen/native/transformers/sdp_utils_cpp.h``: the shared checks (``check_for_dropout``,
  ``check_batch_size_and_num_heads_dense``, ``check_grouped_query_attention``, ``check_attn_mask_shape``,
  ``check_for_attn_mask``, ``check_tensor_dtype``).
- ``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``: ``select_sdp_backend``,
  ``priority_order``, ``check_prefer_cudnn_attention``, ``can_use_flash_attention``,
  ``can_use_mem_efficient_attention``, ``can_use_cudnn_attention`` and their ``check_*`` filters.

The CPU rules and every CPU ``saved_bytes`` figure were measured on torch 2.13 (tests/unit/
test_sdpa_dispatch.py); the CUDA rules and CUDA-only saved tensors are read from the source and not
measured. See docs/attention.md for the tables and what is uncertain.

Backend names: ``"flash"``, ``"efficient"``, ``"cudnn"``, ``"math"``. On CPU ``"flash"`` is
``_scaled_dot_product_flash_attention_for_cpu``, a different kernel from CUDA's FlashAttention-2.
"""

from __future__ import annotations

TORCH_VERSIONS = ((2, 6), (2, 13))  # inclusive range this model covers

_DTYPES = {
    "fp32": "fp32",
    "float32": "fp32",
    "float": "fp32",
    "bf16": "bf16",
    "bfloat16": "bf16",
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    "fp64": "fp64",
    "float64": "fp64",
    "double": "fp64",
}

# cuDNN runtime bundled with the default PyPI CUDA wheel of each torch release (the nvidia-cudnn-cu*
# pin), as major*10000 + minor*100 + patch like cudnnGetVersion(): 9.10.2 -> 91002. Approximate:
# other CUDA variants of a release pin other cuDNNs; pass cudnn_version to override.
_BUNDLED_CUDNN = {
    (2, 6): 90100,  # cu124: 9.1.0
    (2, 7): 90501,  # cu126: 9.5.1
    (2, 8): 91002,  # cu128: 9.10.2
    (2, 9): 91002,  # cu128: 9.10.2
    (2, 10): 91002,  # below the 9.15.0 bar, per huggingface/transformers#48163's reading of 2.10
    (2, 11): 91900,  # 9.19.0 (pytorch/pytorch#193893)
    (2, 12): 91900,
    (2, 13): 92000,  # 9.20.0 (pytorch/pytorch#193893)
}


def normalize_dtype(dtype: str) -> str:
    """``"bf16"``/``"bfloat16"`` ... -> one of fp32, bf16, fp16, fp64; ValueError otherwise."""
    try:
        return _DTYPES[dtype.lower().removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"unsupported SDPA dtype {dtype!r}") from None


def _check_version(torch_version: tuple[int, int]) -> None:
    if not TORCH_VERSIONS[0] <= tuple(torch_version) <= TORCH_VERSIONS[1]:
        raise ValueError(f"the SDPA model covers torch 2.6 to 2.13, not {torch_version}")


def _check_heads(q_heads: int, kv_heads: int, enable_gqa: bool) -> None:
    """Shapes SDPA accepts at all: equal heads, or kv_heads dividing q_heads.

    Unequal heads without ``enable_gqa`` only run when kv_heads == 1 (the math path's matmul
    broadcasts a single K/V head); with ``enable_gqa`` the math path's
    ``pre_process_group_query_attention_input`` (attention.cpp) checks divisibility.
    """
    if q_heads <= 0 or kv_heads <= 0:
        raise ValueError("head counts must be positive")
    if q_heads != kv_heads and q_heads % kv_heads:
        raise ValueError(f"kv_heads {kv_heads} does not divide q_heads {q_heads}")
    if q_heads != kv_heads and not enable_gqa and kv_heads != 1:
        raise ValueError(
            f"q_heads {q_heads} != kv_heads {kv_heads} without enable_gqa: SDPA cannot broadcast; "
            "pass enable_gqa=True, or kv_heads=q_heads when K/V were repeated by the caller"
        )


def heads_ok(q_heads: int, kv_heads: int, *, enable_gqa: bool, supports_gqa: bool) -> bool:
    """A fused kernel's head-count filter on dense inputs.

    ``sdp_utils_cpp.h: check_batch_size_and_num_heads_dense``: equal heads always pass; unequal heads
    pass only when the backend supports GQA and ``enable_gqa`` is set (then
    ``check_grouped_query_attention``: q_heads divisible by kv_heads).
    """
    if q_heads == kv_heads:
        return True
    return enable_gqa and supports_gqa and q_heads % kv_heads == 0


def cpu_flash_ok(
    dtype: str,
    q_heads: int,
    kv_heads: int,
    *,
    enable_gqa: bool,
    dropout: float = 0.0,
    attn_mask: bool = False,
    torch_version: tuple[int, int] = (2, 13),
) -> bool:
    """Whether the CPU flash kernel accepts the call.

    ``sdp_utils_cpp.cpp: use_flash_attention_cpp``: ``check_for_dropout`` (dropout must be 0),
    ``check_batch_size_and_num_heads_dense<supports_gqa>`` (GQA: true in the 2.13 source; false in
    the 2.5/2.6-era source, so 2.6 is modelled without it, see docs/attention.md),
    ``check_attn_mask_shape`` (a mask is accepted if it does not require grad and is 2-D or 4-D
    broadcastable; assumed), ``check_head_dim_size_cpp`` (q, k, v of one head dim: always here),
    ``check_tensor_dtype`` with {fp32, fp64, bf16, fp16}. ``requires_grad`` plays no part.
    """
    del attn_mask  # accepted by the CPU flash kernel (mask without grad)
    if dropout > 0.0:
        return False
    if normalize_dtype(dtype) not in ("fp32", "fp64", "bf16", "fp16"):
        return False
    return heads_ok(q_heads, kv_heads, enable_gqa=enable_gqa, supports_gqa=torch_version >= (2, 7))


def _sm_in(capability: tuple[int, int], low: tuple[int, int], high: tuple[int, int]) -> bool:
    """``cuda/sdp_utils.cpp: check_sm_version<low, high>``: inclusive on (major, minor)."""
    return low <= tuple(capability) <= high


def _fused_sm_high(torch_version: tuple[int, int]) -> tuple[int, int]:
    """Newest architecture the CUDA fused kernels accept.

    ``check_flash_attention_hardware_support`` / ``check_mem_efficient_hardware_support`` /
    ``check_cudnn_hardware_support``: ``[.., sm90]`` in the 2.6-era source, ``[.., sm121]`` in the
    2.9-era and later sources. 2.7 and 2.8 (the first Blackwell wheels) are modelled as sm121 too.
    """
    return (9, 0) if torch_version < (2, 7) else (12, 1)


def cuda_flash_ok(
    dtype: str,
    head_dim: int,
    q_heads: int,
    kv_heads: int,
    *,
    enable_gqa: bool,
    causal: bool = True,
    dropout: float = 0.0,
    attn_mask: bool = False,
    requires_grad: bool = True,
    capability: tuple[int, int] = (9, 0),
    torch_version: tuple[int, int] = (2, 13),
    q_len: int | None = None,
    kv_len: int | None = None,
) -> bool:
    """Whether CUDA FlashAttention-2 accepts the call (``cuda/sdp_utils.cpp: can_use_flash_attention``).

    Filters: ``check_for_attn_mask`` (no mask at all); ``check_head_dim_size_flash`` (q, k, v of one
    head dim, <= 256; a head dim not a multiple of 8 is padded to one by ``pad_last_dim`` in
    attention.cpp, not rejected); ``check_flash_attention_hardware_support`` ([sm80, sm90] for 2.6,
    [sm80, sm121] later); ``check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89`` (training
    on sm86-sm89, and sm120/121 from 2.7, rejects head dim in (192, 224], and (224, 256] with
    dropout); ``check_flash_causal_non_square_seqlens`` (causal needs q_len == kv_len);
    ``check_dtypes_low_precision`` (fp16/bf16 on sm80+); dense ``check_batch_size_and_num_heads_dense
    <supports_gqa=true>``. Dropout is allowed.
    """
    if attn_mask or head_dim > 256 or head_dim <= 0:
        return False
    if not _sm_in(capability, (8, 0), _fused_sm_high(torch_version)):
        return False
    sm86_89 = _sm_in(capability, (8, 6), (8, 9))
    sm120 = torch_version >= (2, 7) and _sm_in(capability, (12, 0), (12, 1))
    if requires_grad and (sm86_89 or sm120):
        if 192 < head_dim <= 224 or (head_dim > 224 and dropout > 0.0):
            return False
    if causal and q_len is not None and kv_len is not None and q_len != kv_len:
        return False
    if normalize_dtype(dtype) not in ("fp16", "bf16"):
        return False
    return heads_ok(q_heads, kv_heads, enable_gqa=enable_gqa, supports_gqa=True)


def _gemm_alignment(dtype: str, capability: tuple[int, int]) -> int:
    """``cuda/sdp_utils.cpp: minimum_gemm_alignment``: 4 on sm80+, raised to 128 bits / element
    width where tensor cores are used (sm80+ always, sm70+ for fp16/bf16): fp16 8, fp32 4 on sm80+;
    fp16 8, fp32 1 on sm70-sm75; 1 below sm70."""
    half = normalize_dtype(dtype) in ("fp16", "bf16")
    major = capability[0]
    align = 4 if major >= 8 else 1
    if major >= 8 or (major >= 7 and half):
        align = max(align, 128 // (16 if half else 32))
    return align


def cuda_efficient_ok(
    dtype: str,
    head_dim: int,
    q_heads: int,
    kv_heads: int,
    *,
    enable_gqa: bool,
    capability: tuple[int, int] = (9, 0),
    torch_version: tuple[int, int] = (2, 13),
) -> bool:
    """Whether the CUDA memory-efficient (xFormers/CUTLASS) kernel accepts the call.

    ``cuda/sdp_utils.cpp: can_use_mem_efficient_attention``: ``check_mem_efficient_hardware_support``
    ([sm50, sm90] for 2.6, [sm50, sm121] later); ``check_head_dim_size_mem_efficient`` (head dim a
    multiple of ``minimum_gemm_alignment``, no upper bound on CUDA); dense
    ``check_batch_size_and_num_heads_dense<supports_gqa=false>`` through 2.13 (native GQA came with
    pytorch/pytorch#191085, after the 2.13 headers: their ``check_batch_size_and_num_heads_dense`` has
    no MQA parameter); dtypes {fp16, fp32, bf16} on sm80+, {fp16, fp32} below. Masks, dropout and
    non-square causal are all accepted.
    """
    if not _sm_in(capability, (5, 0), _fused_sm_high(torch_version)):
        return False
    if head_dim <= 0 or head_dim % _gemm_alignment(dtype, capability):
        return False
    allowed = ("fp16", "fp32", "bf16") if capability[0] >= 8 else ("fp16", "fp32")
    if normalize_dtype(dtype) not in allowed:
        return False
    return heads_ok(q_heads, kv_heads, enable_gqa=enable_gqa, supports_gqa=False)


def cuda_cudnn_ok(
    dtype: str,
    head_dim: int,
    q_heads: int,
    kv_heads: int,
    *,
    enable_gqa: bool,
    dropout: float = 0.0,
    capability: tuple[int, int] = (9, 0),
    torch_version: tuple[int, int] = (2, 13),
    cudnn_version: int | None = None,
    q_len: int | None = None,
    kv_len: int | None = None,
) -> bool:
    """Whether cuDNN attention accepts the call (``cuda/sdp_utils.cpp: can_use_cudnn_attention``).

    ``check_cudnn_hardware_support`` ([sm80, sm90] for 2.6, [sm80, sm121] later);
    ``check_dtypes_low_precision`` (fp16/bf16); ``check_cudnn_tensor_shapes`` (head dim <= 128 and a
    multiple of 8; 256 only with cuDNN > 9.22 on sm90/sm10x, above every bundled cuDNN here, so not
    modelled; key length != 1, and in 2.6 query length != 1 too); dropout rejected for cuDNN
    9.11-9.13 (from 2.9) and, from 2.11, unless a multiple of 1/16 (``check_cudnn_dropout``, in the
    newest source; its release is not pinned down); heads: 2.6 did not check them (any divisible
    count ran), later ``check_batch_size_and_num_heads_dense<supports_gqa=true,
    requires_same_num_heads=false>`` (unequal heads need ``enable_gqa``). Masks are accepted.
    """
    cudnn = _BUNDLED_CUDNN[torch_version] if cudnn_version is None else cudnn_version
    if not _sm_in(capability, (8, 0), _fused_sm_high(torch_version)):
        return False
    if normalize_dtype(dtype) not in ("fp16", "bf16"):
        return False
    if head_dim <= 0 or head_dim > 128 or head_dim % 8:
        return False
    if kv_len == 1 or (torch_version < (2, 7) and q_len == 1):
        return False
    if dropout > 0.0:
        if torch_version >= (2, 9) and 91100 < cudnn < 91400:
            return False
        if torch_version >= (2, 11) and dropout * 16 != int(dropout * 16):
            return False
    if torch_version < (2, 7):
        return q_heads % kv_heads == 0
    return heads_ok(q_heads, kv_heads, enable_gqa=enable_gqa, supports_gqa=True)


def cuda_priority(
    torch_version: tuple[int, int], capability: tuple[int, int] | None, cudnn_version: int | None = None
) -> tuple[str, ...]:
    """The order ``select_sdp_backend`` tries CUDA backends in, the first that accepts winning.

    Default (``at::Context`` SDP priority order, 2.5.1 on, pytorch/pytorch#138522 made cuDNN opt-in
    after 2.5.0 had put it first on H100): flash, efficient, math, cudnn. Math always accepts, so in
    this order cuDNN is never chosen by default. ``check_prefer_cudnn_attention`` moves cuDNN first:
    2.9 (pytorch/pytorch#162073): sm90 or sm100 exactly (minor 0), built with cuDNN >= 9.9; 2.10 on
    (pytorch/pytorch#171627, #169849): runtime cuDNN > 9.15.0 and sm9x/sm10x with minor 0 or 3 (the
    newest source also takes any minor on CUDA 13 builds; not modelled). ``TORCH_CUDNN_SDPA_PREFERRED``
    / ``TORCH_CUDNN_SDPA_DEPRIORITIZED`` environment overrides are not modelled.
    """
    default = ("flash", "efficient", "math", "cudnn")
    cudnn_first = ("cudnn", "flash", "efficient", "math")
    if capability is None:
        return default
    cudnn = _BUNDLED_CUDNN[torch_version] if cudnn_version is None else cudnn_version
    major, minor = capability
    if torch_version == (2, 9) and major in (9, 10) and minor == 0 and cudnn >= 90900:
        return cudnn_first
    if torch_version >= (2, 10) and major in (9, 10) and minor in (0, 3) and cudnn > 91500:
        return cudnn_first
    return default


def sdpa_backend(
    device: str,
    dtype: str,
    head_dim: int,
    q_heads: int,
    kv_heads: int,
    *,
    enable_gqa: bool,
    causal: bool = True,
    dropout: float = 0.0,
    attn_mask: bool = False,
    requires_grad: bool = True,
    capability: tuple[int, int] | None = (9, 0),
    torch_version: tuple[int, int] = (2, 11),
    cudnn_version: int | None = None,
    q_len: int | None = None,
    kv_len: int | None = None,
    v_head_dim: int | None = None,
) -> str:
    """The backend default SDPA dispatch picks: "flash", "efficient", "cudnn" or "math".

    ``v_head_dim``: the value heads' width when it differs from the query / key heads' (MLA:
    192 against 128). The CPU flash kernel (``check_head_dim_size_cpp``) and CUDA's flash kernel
    (``check_head_dim_size_flash``) need one head dim for q, k and v; the memory-efficient kernel
    takes a different value dim if both are aligned (``check_head_dim_size_mem_efficient``);
    cuDNN is not offered one here (its support for unequal dims varies by cuDNN release: not
    modelled, not measured).

    ``attention.cpp: scaled_dot_product_attention`` asks the device's ``_fused_sdp_choice``.
    CPU (``sdp_utils_cpp.cpp: select_sdp_backend_cpp``): flash if ``cpu_flash_ok``, else math.
    CUDA (``cuda/sdp_utils.cpp: select_sdp_backend``): the first of ``cuda_priority`` whose
    ``can_use_*`` accepts, math accepting everything. ``kv_heads`` is the head count of the K/V
    tensors passed in: with ``enable_gqa=False`` and K/V repeated by the caller, pass q_heads.
    ``capability`` is the CUDA compute capability (ignored on CPU); ``cudnn_version`` the runtime
    cuDNN (default: what the release's PyPI wheel bundles); ``q_len``/``kv_len`` only matter when
    they differ (causal flash) or are 1 (cuDNN). Masks are assumed not to require grad.
    """
    _check_version(torch_version)
    _check_heads(q_heads, kv_heads, enable_gqa)
    normalize_dtype(dtype)
    split_v = v_head_dim is not None and v_head_dim != head_dim
    if device == "cpu" and split_v:
        return "math"
    if device == "cpu":
        ok = cpu_flash_ok(
            dtype,
            q_heads,
            kv_heads,
            enable_gqa=enable_gqa,
            dropout=dropout,
            attn_mask=attn_mask,
            torch_version=torch_version,
        )
        return "flash" if ok else "math"
    if device != "cuda":
        raise ValueError(f"device must be 'cpu' or 'cuda', not {device!r}")
    if capability is None:
        raise ValueError("CUDA dispatch needs the compute capability")
    checks = {
        "flash": lambda: cuda_flash_ok(
            dtype,
            head_dim,
            q_heads,
            kv_heads,
            enable_gqa=enable_gqa,
            causal=causal,
            dropout=dropout,
            attn_mask=attn_mask,
            requires_grad=requires_grad,
            capability=capability,
            torch_version=torch_version,
            q_len=q_len,
            kv_len=kv_len,
        ),
        "efficient": lambda: cuda_efficient_ok(
            dtype,
            head_dim,
            q_heads,
            kv_heads,
            enable_gqa=enable_gqa,
            capability=capability,
            torch_version=torch_version,
        ),
        "cudnn": lambda: cuda_cudnn_ok(
            dtype,
            head_dim,
            q_heads,
            kv_heads,
            enable_gqa=enable_gqa,
            dropout=dropout,
            capability=capability,
            torch_version=torch_version,
            cudnn_version=cudnn_version,
            q_len=q_len,
            kv_len=kv_len,
        ),
        "math": lambda: True,
    }
    if split_v:
        efficient = checks["efficient"]
        checks["flash"] = checks["cudnn"] = lambda: False
        checks["efficient"] = lambda: efficient() and v_head_dim % _gemm_alignment(dtype, capability) == 0
    for backend in cuda_priority(torch_version, capability, cudnn_version):
        if checks[backend]():
            return backend
    raise AssertionError("unreachable: math accepts every call")


def math_compute_bytes(d: int, *, allow_fp16_bf16_reduction: bool = False) -> int:
    """Element size the math path computes in.

    ``attention.cpp: _scaled_dot_product_attention_math`` casts fp16/bf16 q, k, v to fp32
    (``query_acc`` ...) unless ``torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)``; the
    result is cast back. So 2-byte inputs compute (and save) in 4 bytes, on CPU and CUDA alike.
    """
    if d < 4 and not allow_fp16_bf16_reduction:
        return 4
    return d


def kept_inputs(
    backend: str, q_heads: int, kv_heads: int, d: int, *, enable_gqa: bool, allow_fp16_bf16_reduction: bool = False
) -> frozenset[str]:
    """Which of SDPA's own tensors q, k, v and out its autograd graph holds (by storage).

    Fused kernels (flash, efficient, cudnn; CPU flash measured) save q, k, v (K/V at kv_heads under
    GQA) and the output. The math path saves none of q, k or out: it saves scaled copies of q and k
    (``query_acc * scaling_factor``, ``key * scaling_factor``); it saves v itself only when v is
    neither upcast (2-byte dtypes) nor repeated (``repeat_interleave`` under GQA). Measured on CPU.
    """
    if backend in ("flash", "efficient", "cudnn"):
        return frozenset({"q", "k", "v", "out"})
    if backend != "math":
        raise ValueError(f"unknown backend {backend!r}")
    upcast = math_compute_bytes(d, allow_fp16_bf16_reduction=allow_fp16_bf16_reduction) != d
    repeated = enable_gqa and q_heads != kv_heads
    return frozenset() if upcast or repeated else frozenset({"v"})


def saved_bytes(
    backend: str,
    b: int,
    s: int,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    d: int,
    *,
    enable_gqa: bool,
    device: str,
    dropout: bool = False,
    allow_fp16_bf16_reduction: bool = False,
) -> dict[str, int]:
    """Bytes SDPA's autograd graph keeps for backward beyond q, k, v and the output, by tensor.

    One call on (b, heads, s, head_dim) inputs of ``d`` bytes per element, self-attention (q and kv
    lengths s), no explicit mask. Which of q, k, v, out are held is ``kept_inputs`` (all four for
    fused kernels; for math at most v); ``total_saved_bytes`` adds them. Keys:

    - flash, CPU (``_scaled_dot_product_flash_attention_cpu``, measured): ``lse`` logsumexp
      (b, s, q_heads) in ``toOpMathType(dtype)``: fp32 for fp32/bf16/fp16, fp64 for fp64.
    - flash, CUDA (``_scaled_dot_product_flash_attention``, source): ``lse`` (b, q_heads, s) fp32;
      ``rng_state`` philox seed and offset, two int64 (16 bytes; host scalars without dropout in some
      releases, counted anyway). Dropout masks are regenerated from the seed, never stored.
    - efficient, CUDA (``_scaled_dot_product_efficient_attention``, source): ``lse`` fp32 of
      (b, q_heads, ceil(s / 32) * 32) (``kAlignLSE`` = 32 padding), ``rng_state`` as flash.
    - cudnn, CUDA (``_scaled_dot_product_cudnn_attention``, source): ``lse`` softmax stats
      (b, q_heads, s, 1) fp32, ``rng_state``.
    - math (``_scaled_dot_product_attention_math``, measured on CPU), in the compute width
      ``a = math_compute_bytes(d)``: ``q_scaled`` (b, q_heads, s, head_dim) saved by the first
      matmul; ``k_scaled`` (b, q_heads, head_dim, s), K after ``repeat_interleave`` to q_heads under
      GQA; ``v_acc`` V as the second matmul sees it, (b, q_heads, s, head_dim) if repeated under GQA
      else (b, kv_heads, s, head_dim), present only when it is not v itself (upcast or repeated);
      ``probs`` the softmax output (b, q_heads, s, s) saved by ``_safe_softmax``. With dropout:
      ``dropout_mask`` (CPU: ``_dropout_impl`` keeps the scaled noise in width a; CUDA:
      ``native_dropout`` keeps a bool mask, 1 byte) and ``probs_dropped`` (b, q_heads, s, s) in width
      a, saved by the second matmul. The causal mask is not saved (``add_`` needs no inputs).
    """
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', not {device!r}")
    rows = b * q_heads * s
    if backend == "flash":
        if device == "cpu":
            if dropout:
                raise ValueError("the CPU flash kernel does not run with dropout")
            return {"lse": rows * max(d, 4)}
        return {"lse": rows * 4, "rng_state": 16}
    if backend in ("efficient", "cudnn"):
        if device == "cpu":
            raise ValueError(f"{backend} attention runs on CUDA only")
        if backend == "efficient":
            return {"lse": b * q_heads * (-(-s // 32) * 32) * 4, "rng_state": 16}
        return {"lse": rows * 4, "rng_state": 16}
    if backend != "math":
        raise ValueError(f"unknown backend {backend!r}")
    a = math_compute_bytes(d, allow_fp16_bf16_reduction=allow_fp16_bf16_reduction)
    repeated = enable_gqa and q_heads != kv_heads
    out = {
        "q_scaled": rows * head_dim * a,
        "k_scaled": rows * head_dim * a,
        "probs": rows * s * a,
    }
    if "v" not in kept_inputs(
        "math", q_heads, kv_heads, d, enable_gqa=enable_gqa, allow_fp16_bf16_reduction=allow_fp16_bf16_reduction
    ):
        out["v_acc"] = b * (q_heads if repeated else kv_heads) * s * head_dim * a
    if dropout:
        out["dropout_mask"] = rows * s * (a if device == "cpu" else 1)
        out["probs_dropped"] = rows * s * a
    return out


def total_saved_bytes(
    backend: str,
    b: int,
    s: int,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    d: int,
    *,
    enable_gqa: bool,
    device: str,
    dropout: bool = False,
    allow_fp16_bf16_reduction: bool = False,
) -> int:
    """Everything the SDPA call's autograd graph holds: ``saved_bytes`` plus the ``kept_inputs``
    (q at q_heads, k and v at kv_heads, out at q_heads, each in ``d`` bytes)."""
    extras = saved_bytes(
        backend,
        b,
        s,
        q_heads,
        kv_heads,
        head_dim,
        d,
        enable_gqa=enable_gqa,
        device=device,
        dropout=dropout,
        allow_fp16_bf16_reduction=allow_fp16_bf16_reduction,
    )
    size = {"q": q_heads, "k": kv_heads, "v": kv_heads, "out": q_heads}
    kept = kept_inputs(
        backend, q_heads, kv_heads, d, enable_gqa=enable_gqa, allow_fp16_bf16_reduction=allow_fp16_bf16_reduction
    )
    return sum(extras.values()) + sum(b * size[name] * s * head_dim * d for name in kept)
