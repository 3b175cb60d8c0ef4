"""`--model FILE.gguf` alone for llama.cpp's deepseek2 architecture: a tiny DeepSeek-V3 (q_lora_rank,
sigmoid noaux_tc over 4 groups keeping 2 with the selection bias, 1 shared expert, 1 dense layer,
YaRN) and a V2-Lite style model (no q_lora_rank, softmax group_limited_greedy, 2 shared experts, 2
dense layers, YaRN) written to GGUF as llama.cpp's converter does (tests/gguf_io/deepseek2_files.py),
in its newer form (kv_b split into attn_k_b / attn_v_b) and its older one (one attn_kv_b).

Tolerances: (a) the GGUF alone against the HF directory plus the GGUF experts (--kt-method
LLAMAFILE): the same numbers reach the same kernels, logits equal to 1e-6. (b) against torch on the
dequantized weights: the CPU kernels' per-token Q8_K activation rounding only, 0.10 relative (as
tests/gguf_io/test_gguf_model.py). (c) every expert on the torch side from the GGUF: the same numbers
in fp32 with another summation order, 1e-4; the same against transformers' own model on that
directory (tests/test_deepseek.py's bound).
"""

from __future__ import annotations

import json

import pytest
import torch
from deepseek2_files import f16_exact_deepseek, write_deepseek2_gguf
from gguf_files import with_experts

from hybridmoe import LLM
from hybridmoe.gguf.deepseek2 import kv_b_from_split
from hybridmoe.gguf.model_config import GGUFConfigError, hf_config
from hybridmoe.gguf.view import gguf_view, read_header

from tiny_models import hf_model, make_tiny_model

PROMPT = torch.randint(0, 4000, (21,), generator=torch.Generator().manual_seed(11)).tolist()
GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64, beta_fast=32,
            beta_slow=1, mscale=0.7, mscale_all_dim=0.7)  # a GGUF holds one mscale (llama.cpp: both equal)
SIZES = dict(hidden_size=256, moe_intermediate_size=256, intermediate_size=96, vocab_size=4096, num_attention_heads=4,
             num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
             n_routed_experts=8, rope_parameters=YARN)
MODELS = {  # name: (tiny_models kind, overrides, expert types by layer)
    "v3": ("deepseek_v3", dict(SIZES, q_lora_rank=48), ("Q4_K", "Q8_0")),
    "v2lite": ("deepseek_v2", dict(SIZES, q_lora_rank=None, n_routed_experts=9, n_group=3, topk_group=2,
                                   num_hidden_layers=4, first_k_dense_replace=2, n_shared_experts=2),
               ("Q8_0", "Q6_K")),
}
CONFIG_KEYS = ("architectures", "model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
               "vocab_size", "intermediate_size", "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok",
               "n_shared_experts", "first_k_dense_replace", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
               "qk_rope_head_dim", "v_head_dim", "n_group", "topk_group", "routed_scaling_factor", "norm_topk_prob",
               "max_position_embeddings", "tie_word_embeddings")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.fixture(scope="module")
def ds_gguf(tmp_path_factory):
    """name -> (HF directory, split-form GGUF, older-form GGUF, HF directory with the GGUF's experts);
    the GGUF without expert group keys is `tiny-{name}-nogroups.gguf` beside them."""
    cache = {}

    def get(name: str):
        if name not in cache:
            kind, overrides, types = MODELS[name]
            d = tmp_path_factory.mktemp(f"ds2_{name}")
            ckpt = make_tiny_model(kind, d / "hf", std=0.1, **overrides)
            f16_exact_deepseek(ckpt)
            deq = write_deepseek2_gguf(ckpt, d / f"tiny-{name}.gguf", types, split=True)
            write_deepseek2_gguf(ckpt, d / f"tiny-{name}-old.gguf", types, split=False)
            write_deepseek2_gguf(ckpt, d / f"tiny-{name}-nogroups.gguf", types, groups=False)
            cache[name] = (ckpt, d / f"tiny-{name}.gguf", d / f"tiny-{name}-old.gguf", with_experts(ckpt, d / "same", deq))
        return cache[name]

    return get


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("form", [1, 2])
def test_config_from_deepseek2_metadata_is_the_checkpoint_config(ds_gguf, name, form):
    ckpt, new, old, _ = ds_gguf(name)
    want = json.loads((ckpt / "config.json").read_text())
    got = json.loads((gguf_view(new if form == 1 else old) / "config.json").read_text())
    for k in CONFIG_KEYS:
        assert got[k] == want[k], (k, got[k], want[k])
    assert got["scoring_func"] == ("sigmoid" if name == "v3" else "softmax")
    assert got["topk_method"] == ("noaux_tc" if name == "v3" else "group_limited_greedy")
    assert got["rope_interleave"] is True and got["num_key_value_heads"] == want["num_attention_heads"]
    rope = got["rope_parameters"]
    assert rope["rope_type"] == "yarn" and rope["factor"] == 4.0 and rope["original_max_position_embeddings"] == 64
    assert rope["mscale"] == rope["mscale_all_dim"] == pytest.approx(0.7, abs=1e-6)


@pytest.mark.parametrize("name", list(MODELS))
def test_deepseek2_gguf_alone_matches_the_hf_directory(ds_gguf, name):
    ckpt, gguf, _, same = ds_gguf(name)
    alone = LLM(str(gguf), device="cpu", progress=False)
    assert alone.args.kt_method == "LLAMAFILE" and alone.engine.model_config.spec.mla is not None
    split = LLM(str(ckpt), device="cpu", progress=False, kt_method="LLAMAFILE", kt_weight_path=str(gguf))
    a, b = split.prompt_logits(PROMPT), alone.prompt_logits(PROMPT)
    assert (a - b).abs().max().item() < 1e-6
    tokens = alone.generate(input_ids=PROMPT, sampling_params=GREEDY)["output_ids"]
    assert tokens == split.generate(input_ids=PROMPT, sampling_params=GREEDY)["output_ids"]
    ref = LLM(str(same), device="cpu", progress=False).prompt_logits(PROMPT)  # torch on the dequantized weights
    err = _rel(b, ref)
    print(f"{name}: GGUF alone (LLAMAFILE experts) vs torch on the dequantized weights: rel {err:.3f}")
    assert err < 0.10
    n_exp = alone.engine.model_config.spec.num_experts
    some = LLM(str(gguf), device="cpu", progress=False, kt_num_gpu_experts=3)  # 3 dequantized, the rest blocks
    assert some.engine.runner.moe.backend == "hybrid"
    assert _rel(some.prompt_logits(PROMPT), ref) < 0.10
    allgpu = LLM(str(gguf), device="cpu", progress=False, kt_num_gpu_experts=n_exp).prompt_logits(PROMPT)
    assert _rel(allgpu, ref) < 1e-4
    with torch.no_grad():
        hf = hf_model(same)(torch.tensor([PROMPT])).logits[0]
    err = _rel(allgpu, hf)
    print(f"{name}: GGUF alone, experts dequantized on the torch side, vs transformers: rel {err:.2e}")
    assert err < 1e-4


@pytest.mark.parametrize("name", list(MODELS))
def test_older_deepseek2_form_gives_the_same_model(ds_gguf, name):
    _, new, old, _ = ds_gguf(name)
    a = LLM(str(new), device="cpu", progress=False).prompt_logits(PROMPT[:9])
    b = LLM(str(old), device="cpu", progress=False).prompt_logits(PROMPT[:9])
    assert (a - b).abs().max().item() < 1e-6


@pytest.mark.parametrize("name", list(MODELS))
def test_a_file_without_expert_groups_routes_over_all_experts(ds_gguf, name):
    """As llama.cpp does with such a file: no group limit (V2: greedy; V3: noaux_tc, one group)."""
    _, new, _, _ = ds_gguf(name)
    nogroups = new.with_name(new.name.replace(".gguf", "-nogroups.gguf"))
    got = json.loads((gguf_view(nogroups) / "config.json").read_text())
    assert (got["n_group"], got["topk_group"]) == (1, 1)
    assert got["topk_method"] == ("noaux_tc" if name == "v3" else "greedy")


@pytest.mark.parametrize("h,lora,nope,v", [(3, 5, 4, 7), (1, 8, 2, 2), (0, 4, 3, 2)])
def test_kv_b_from_split_inverts_the_converters_split(h, lora, nope, v):
    kv_b = torch.randn(h * (nope + v), lora)
    per_head = kv_b.reshape(h, nope + v, lora)
    k_b, v_b = per_head[:, :nope].transpose(1, 2), per_head[:, nope:]  # what convert_hf_to_gguf.py writes
    assert torch.equal(kv_b_from_split(k_b, v_b), kv_b)


@pytest.mark.gpu
@pytest.mark.parametrize("gpu", [0, 3])
def test_deepseek2_gguf_on_cuda_matches_the_cpu_device(ds_gguf, gpu):
    """The H200 run: bf16 MLA and dense layers on the GPU, `gpu` experts per layer dequantized there,
    the rest on the CPU kernels, CUDA graphs on; against the same file on the CPU device (fp32), with
    the bound of cuda_parity.py."""
    from cuda_parity import check_cuda_against_cpu

    _, gguf, _, same = ds_gguf("v3")
    check_cuda_against_cpu(gguf, same, gpu, PROMPT, GREEDY, "deepseek2 GGUF")


def test_check_reports_llamafile_for_a_deepseek2_gguf(ds_gguf, capsys):
    from hybridmoe.check import check_main

    _, gguf, _, _ = ds_gguf("v3")
    assert check_main(["--model", str(gguf), "--json"]) in (0, 1)
    report = json.loads(capsys.readouterr().out)
    assert report["recommended_flags"]["--kt-method"] == "LLAMAFILE"
    assert report["gguf_tensor_types"]["experts"] == {"Q4_K": 3, "Q8_0": 3}
    assert report["sizing"]["num_experts"] == 8


def test_convert_a_deepseek2_gguf_to_bf16(ds_gguf, tmp_path):
    from hybridmoe.convert import main as convert_main

    _, gguf, _, same = ds_gguf("v2lite")
    out = tmp_path / "bf16"
    assert convert_main(["--input-path", str(gguf), "--input-type", "gguf", "--output", str(out),
                         "--quant-method", "bf16", "--no-progress"]) == 0
    llm = LLM(str(gguf), device="cpu", progress=False, kt_method="BF16", kt_weight_path=str(out))
    err = _rel(llm.prompt_logits(PROMPT), LLM(str(same), device="cpu", progress=False).prompt_logits(PROMPT))
    print(f"deepseek2 GGUF -> convert bf16: rel {err:.2e}")
    assert err < 2e-2  # bf16 weights and activations in the CPU kernels (test_gguf_tools.py's bound)


@pytest.mark.parametrize("form", ["split", "old"])
def test_startup_checks_accept_a_deepseek2_gguf(ds_gguf, form):
    """startup.prepare: config, tokenizer, every tensor's shape (kv_b_proj from attn_k_b / attn_v_b
    in the split form), the GGUF experts."""
    from hybridmoe.config import EngineArgs
    from hybridmoe.startup import prepare

    _, new, old, _ = ds_gguf("v3")
    gguf = new if form == "split" else old
    args = prepare(EngineArgs.from_kwargs(model_path=str(gguf), device="cpu"))
    assert (args.kt_method, args.kt_weight_path) == ("LLAMAFILE", str(gguf))


def test_deepseek2_metadata_that_is_neither_v2_nor_v3_is_refused(ds_gguf):
    _, gguf, _, _ = ds_gguf("v3")
    meta, shapes = read_header([gguf])
    hf_config(meta, shapes, "x.gguf")  # as written: fine
    no_bias = {k: s for k, s in shapes.items() if ".exp_probs_b." not in k}
    with pytest.raises(GGUFConfigError, match="x.gguf: sigmoid expert gating without exp_probs_b"):
        hf_config(meta, no_bias, "x.gguf")
    with pytest.raises(GGUFConfigError, match="x.gguf: routed experts in layers"):
        hf_config({**meta, "deepseek2.leading_dense_block_count": 0}, shapes, "x.gguf")
    with pytest.raises(GGUFConfigError, match="expert_gating_func 3"):
        hf_config({**meta, "deepseek2.expert_gating_func": 3}, shapes, "x.gguf")
