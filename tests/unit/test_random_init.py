"""A checkpoint that is still its random initialisation (``ModelSpec.random_init``): read off a model
folder's safetensors (memplan/specs/checkpoint.py) and off a live model (MemplanCallback), and what it
changes: an LLM.int8 base's outlier columns on CUDA (timeline/int8_outliers.py), nothing else."""

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from memplan import api  # noqa: E402
from memplan.costmodel.timeline.hf_bnb import Bnb8bit  # noqa: E402
from memplan.costmodel.timeline.int8_outliers import RandomInit  # noqa: E402
from memplan.specs.checkpoint import random_init  # noqa: E402
from memplan.specs.loader import load_model  # noqa: E402
from memplan.specs.plan import Plan  # noqa: E402

TINY = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=256, max_position_embeddings=128,
)  # fmt: skip


def _saved(tmp_path, cls=transformers.LlamaConfig, touch=None, **kwargs):
    """A model built from_config and saved to ``tmp_path`` (``touch`` edits it first); the folder."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cls(**TINY, **kwargs))
    if touch is not None:
        with torch.no_grad():
            touch(model)
    model.save_pretrained(tmp_path)
    return tmp_path


def test_a_saved_random_model_is_read_as_random(tmp_path):
    assert load_model(str(_saved(tmp_path, initializer_range=0.03))).random_init == 0.03
    assert load_model(str(tmp_path / "config.json")).random_init == 0.03  # the config file itself


def test_a_trained_norm_makes_it_trained(tmp_path):
    def train_final_norm(model):
        model.model.norm.weight.add_(0.01)

    assert load_model(str(_saved(tmp_path, touch=train_final_norm))).random_init is None


def test_a_sharded_checkpoint_is_read_through_its_index(tmp_path):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**TINY))
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file() and not (tmp_path / "model.safetensors").exists()
    assert load_model(str(tmp_path)).random_init == 0.02


def test_bf16_weights_and_gemmas_zero_norms_are_read(tmp_path):
    """Gemma 3's norms scale by ``1 + weight`` and start at zero; a bf16 checkpoint stores 2-byte ones."""
    torch.manual_seed(0)
    cfg = transformers.Gemma3TextConfig(**TINY, head_dim=16)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    assert not model.model.norm.weight.any()
    model.to(torch.bfloat16).save_pretrained(tmp_path / "gemma")
    assert load_model(str(tmp_path / "gemma")).random_init == 0.02
    _saved(tmp_path / "llama")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "llama").to(torch.bfloat16)
    model.save_pretrained(tmp_path / "llama16")
    assert load_model(str(tmp_path / "llama16")).random_init == 0.02


@pytest.mark.parametrize(
    "weights",
    [None, b"", b"\x00" * 7, b"\xff" * 8 + b"{", (5).to_bytes(8, "little") + b"{ bad"],
    ids=["none", "empty", "short", "huge-header", "bad-json"],
)
def test_an_unreadable_or_missing_checkpoint_is_taken_as_trained(tmp_path, weights):
    """The weights are not an input of the estimate: a folder without them, or with a file memplan cannot
    read, is estimated as trained, with no error."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"],
                                                       **TINY}))  # fmt: skip
    if weights is not None:
        (tmp_path / "model.safetensors").write_bytes(weights)
    assert random_init(tmp_path, {}) is None and load_model(str(tmp_path)).random_init is None


def test_only_an_int8_base_reads_it():
    """The outlier columns of each int8 linear: RandomInit's over a random checkpoint, none over a
    trained one; a 4-bit or float base has none to count."""
    model = load_model("llama3-8b")
    random = model.model_copy(update={"random_init": 0.02})
    int8 = Plan(finetune="lora", quant="int8", precision="bf16-mixed")
    assert Bnb8bit.of(int8, model).outliers == 0
    assert Bnb8bit.of(int8, random).outliers == RandomInit(4096, 0.02)
    assert Bnb8bit.of(Plan(finetune="qlora"), random) is None


def test_the_estimate_of_a_random_int8_checkpoint_keeps_the_columns():
    """On CUDA the down projections' ``subA`` (tokens x k fp32 per call, kept with the graph) raise the
    Trainer's peak over a random base; CPU's MatMul8bitFp keeps none, and a 4-bit base is unchanged."""
    plan = dict(finetune="lora", quant="int8", precision="bf16-mixed", recompute="full", lora_targets=["all-linear"])
    work = dict(seq_len=256, micro_batch=1, global_batch=1)
    trained = api.model_spec(Path(__file__).parents[1] / "data" / "gpu-traces" / "llama1b.config.json")[0]
    random = trained.model_copy(update={"random_init": 0.02})

    def peak(model, device="cuda", **change):
        r = api.estimate(model, plan={**plan, **change}, workload=work, gpu="h200", runtime="hf", device=device)
        assert r.memory.model == "op-level"
        return r.memory.peak.allocated

    assert peak(random) > peak(trained)
    assert peak(random, "cpu") == peak(trained, "cpu")
    assert peak(random, quant="nf4", finetune="qlora") == peak(trained, quant="nf4", finetune="qlora")


def test_the_callback_reads_a_live_model():
    """MemplanCallback's rule on the weights in memory: the norms at their initial value, the config's
    ``initializer_range``; one trained norm makes the model trained; a model without norms says nothing."""
    from memplan.integrations.transformers import _random_init

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**TINY, initializer_range=0.01)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    assert _random_init(model, cfg) == 0.01
    with torch.no_grad():
        model.model.layers[1].post_attention_layernorm.weight[3] = 0.5
    assert _random_init(model, cfg) is None
    assert _random_init(torch.nn.Linear(4, 4), cfg) is None
