"""On CUDA: the grammar bitmask and logit_bias in the sampler give the CPU reference's results and queue no
host synchronization (torch's sync debug mode raises on any), and a demo-model engine with CUDA-graph
decode keeps its graphs while constrained requests follow their grammar."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from hybridmoe.engine.grammar import GrammarBackend, RequestGrammar
from hybridmoe.engine.grammar_mask import BatchBitmask, apply_bitmask_reference
from hybridmoe.engine.request import Req, SamplingParams
from hybridmoe.engine.sampler import Sampler

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
# the grammars compile with xgrammar (the [structured] extra): a GPU machine without it skips, as the CPU
# grammar tests fail to collect there, instead of three failures that say only "not installed"
pytest.importorskip("xgrammar", reason="structured output needs xgrammar (pip install 'hybridmoe[structured]')")

VOCAB = ["a", "b", "c", "ab", "{", "}", '"', "x", " ", ":", "1", "2", "12", "<eos>"] + [f"w{i}" for i in range(51)]
EOS = 13
DEMO = Path(__file__).resolve().parents[1] / "hybridmoe" / "demo_model"


def _grammars() -> list[RequestGrammar | None]:
    be = GrammarBackend.for_vocab(VOCAB, [EOS], vocab_size=len(VOCAB) + 7)
    g1 = RequestGrammar(be.compile("regex", "(ab|c)+"))
    g2 = RequestGrammar(be.compile("json_schema", '{"type": "object"}'))
    return [g1, None, g2]


def test_bitmask_on_cuda_matches_the_cpu_reference():
    grammars = _grammars()
    v = len(VOCAB) + 7
    logits = torch.randn(3, v, device="cuda")
    got = logits.clone()
    BatchBitmask(v).apply(got, grammars)
    mask = BatchBitmask(v).fill(grammars, torch.device("cpu"))
    want = apply_bitmask_reference(logits.cpu(), mask, v)
    assert torch.equal(got.cpu(), want)


def test_constrain_queues_no_host_sync():
    grammars = _grammars()
    v = len(VOCAB) + 7
    s = Sampler(v, [EOS])
    reqs = [Req(rid=str(i), prompt_ids=[1], params=SamplingParams(temperature=0.0, logit_bias={"2": 3.0, "5": -1.0}),
                grammar=g) for i, g in enumerate(grammars)]
    logits = torch.randn(3, v + 5, device="cuda", dtype=torch.bfloat16)
    s._constrain(logits, reqs)  # first call: buffers, pinned memory, Triton compile
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = s._constrain(logits, reqs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    mask = BatchBitmask(v).fill(grammars, torch.device("cpu"))
    bias = torch.zeros(v)
    bias[2], bias[5] = 3.0, -1.0
    want = apply_bitmask_reference(logits[:, :v].float().cpu() + bias, mask, v)
    assert torch.equal(out.cpu(), want)


@pytest.mark.skipif(not (DEMO / "config.json").is_file(), reason="the demo model is not built")
def test_cuda_graph_decode_with_grammars():
    from hybridmoe import LLM

    llm = LLM(str(DEMO), device="cuda", progress=False)
    assert llm.engine.runner.graphs is not None  # decode runs in CUDA graphs
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["n"]}
    params = [{"max_new_tokens": 400, "temperature": 1.0, "sampling_seed": i, "json_schema": json.dumps(schema)}
              for i in range(4)] + [{"max_new_tokens": 400, "temperature": 1.0, "regex": "[a-c]{2,5}!"},
                                    {"max_new_tokens": 8, "temperature": 1.0}]
    outs = llm.generate([f"prompt {i}" for i in range(len(params))], params)
    for o in outs[:4]:
        assert o["meta_info"]["finish_reason"]["type"] == "stop"
        assert 0 <= json.loads(o["text"])["n"] <= 99
    assert re.fullmatch(r"[a-c]{2,5}!", outs[4]["text"])
    assert outs[5]["meta_info"]["completion_tokens"] == 8
