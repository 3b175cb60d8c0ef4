"""Sampler: logit_bias and grammar masks against a direct reference on synthetic logits; the parameters'
validation (logit_bias ids and values, at most one structured-output constraint)."""

from __future__ import annotations

import pytest
import torch

from hybridmoe.engine.grammar import GrammarBackend, RequestGrammar
from hybridmoe.engine.request import Req, SamplingParams, SamplingParamsError
from hybridmoe.engine.sampler import Sampler

VOCAB = ["a", "b", "c", "ab", "{", "}", '"', "x", " ", ":", "1", "2", "12", "<eos>"]
EOS = len(VOCAB) - 1


def _req(rid="r", out=(), grammar=None, **params) -> Req:
    return Req(rid=rid, prompt_ids=[1], params=SamplingParams(**params), output_ids=list(out), grammar=grammar)


def _dense(bias: dict, v: int) -> torch.Tensor:
    d = torch.zeros(v)
    for k, b in bias.items():
        d[int(k)] += b
    return d


@pytest.mark.parametrize("v", [1, 7, 50, 129])
def test_logit_bias_greedy_and_logprobs_match_reference(v):
    torch.manual_seed(v)
    logits = torch.randn(4, v + 3)  # padded columns beyond the vocabulary
    biases = [{str(v - 1): 5.0, "0": -2.5}, {}, {"0": 100}, {str(v // 2): -100.0}]
    reqs = [_req(rid=str(i), temperature=0.0, logit_bias=b or None) for i, b in enumerate(biases)]
    for r in reqs:
        r.return_logprob = True
    s = Sampler(v, [])
    out = s(logits.clone(), reqs)
    want = logits[:, :v] + torch.stack([_dense(b, v) for b in biases])
    assert out.next_ids == want.argmax(-1).tolist()
    ref_lp = torch.log_softmax(want, -1).gather(1, torch.tensor(out.next_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(out.logprobs), ref_lp)


def test_logit_bias_forces_and_bans_when_sampling():
    torch.manual_seed(0)
    v = 40
    logits = torch.randn(64, v) * 3
    s = Sampler(v, [])
    forced = s(logits.clone(), [_req(rid=str(i), temperature=1.0, logit_bias={"17": 100}) for i in range(64)])
    assert forced.next_ids == [17] * 64
    top = logits.argmax(-1)
    banned = s(logits.clone(), [_req(rid=str(i), temperature=0.0, logit_bias={str(int(top[i])): -100})
                                for i in range(64)])
    assert all(t != int(top[i]) for i, t in enumerate(banned.next_ids))


def test_logit_bias_tensors_follow_the_batch_composition():
    """The (index, value) tensors are cached per batch composition: a new request at the same row with the
    same rid (a reused client rid) must get its own bias, and rows shifting must move the bias along."""
    v = 20
    logits = torch.zeros(2, v)
    s = Sampler(v, [])
    a, b = _req(rid="x", temperature=0.0, logit_bias={"3": 10}), _req(rid="y", temperature=0.0)
    assert s(logits.clone(), [a, b]).next_ids == [3, 0]
    assert s(logits.clone(), [a, b]).next_ids == [3, 0]  # cached
    assert s(logits.clone(), [b, a]).next_ids == [0, 3]  # rows moved
    a2 = _req(rid="x", temperature=0.0, logit_bias={"5": 10})
    assert s(logits.clone(), [a2, b]).next_ids == [5, 0]


def test_bias_leaves_the_callers_logits_alone():
    logits = torch.zeros(1, 8)
    Sampler(8, [])(logits, [_req(temperature=0.0, logit_bias={"2": 3})])
    assert torch.equal(logits, torch.zeros(1, 8))


def _grammar(text: str, kind: str = "regex") -> RequestGrammar:
    be = GrammarBackend.for_vocab(VOCAB, [EOS])
    return RequestGrammar(be.compile(kind, text))


def test_grammar_rows_pick_allowed_tokens_and_others_are_unchanged():
    torch.manual_seed(1)
    v = len(VOCAB)
    s = Sampler(v, [EOS])
    for trial in range(30):
        logits = torch.randn(3, v) * 4
        g = _grammar("(ab|c)+")
        reqs = [_req(rid="g", grammar=g, temperature=1.0, sampling_seed=trial), _req(rid="p", temperature=0.0),
                _req(rid="q", grammar=_grammar("1|2"), temperature=0.0)]
        out = s(logits.clone(), reqs)
        assert out.next_ids[0] in (VOCAB.index("a"), VOCAB.index("ab"), VOCAB.index("c"))  # "a" then "b" too
        assert out.next_ids[1] == int(logits[1].argmax())
        want = VOCAB.index("1") if logits[2, VOCAB.index("1")] > logits[2, VOCAB.index("2")] else VOCAB.index("2")
        assert out.next_ids[2] == want


def test_greedy_grammar_generation_ends_at_the_stop_token():
    """Driving a matcher the way the engine does: greedy tokens until it terminates."""
    v = len(VOCAB)
    s = Sampler(v, [EOS])
    logits = torch.zeros(1, v)
    logits[0, VOCAB.index("x")] = 5.0  # the model wants x, which the grammar never allows
    logits[0, VOCAB.index("b")] = 1.0
    req = _req(grammar=_grammar("a(b)*c", kind="regex"), temperature=0.0)
    text = []
    for _ in range(10):
        tok = s(logits.clone(), [req]).next_ids[0]
        req.grammar.accept(tok)
        req.output_ids.append(tok)
        if req.grammar.terminated:
            break
        text.append(VOCAB[tok])
        if len(text) == 4:
            logits[0, VOCAB.index("c")] = 3.0  # now c wins over b
    assert req.grammar.terminated and "".join(text) == "abbbc"


def test_min_new_tokens_does_not_fight_the_grammar():
    """min_new_tokens bans the stop tokens, but where a grammar ends only they are allowed: the grammar wins
    (no row with every token at -inf)."""
    v = len(VOCAB)
    g = _grammar("a")
    g.accept(VOCAB.index("a"))
    out = Sampler(v, [EOS])(torch.randn(1, v), [_req(out=[0], grammar=g, temperature=0.0, min_new_tokens=5)])
    assert out.next_ids == [EOS]


@pytest.mark.parametrize("bias,word", [
    ({"x": 1}, "logit_bias"), ({"-1": 1}, "logit_bias"), ({"100": 1}, "logit_bias"), ({"1": 100.5}, "logit_bias"),
    ({"1": True}, "logit_bias"), ({"1": float("nan")}, "logit_bias"), ({" 1": 1}, "logit_bias"),
    ({str(i): 1 for i in range(4097)}, "logit_bias"), ([1], "logit_bias"),
])
def test_bad_logit_bias_is_refused(bias, word):
    with pytest.raises(SamplingParamsError, match=word):
        SamplingParams(logit_bias=bias).validate(vocab_size=100)


def test_good_logit_bias_and_its_items():
    p = SamplingParams(logit_bias={"3": -100, "0": 100, 7: 0.5, "03": 1})
    p.validate(vocab_size=8)
    assert sorted(p.logit_bias_items) == [(0, 100.0), (3, 1.0), (7, 0.5)]  # "03" is id 3: the last one wins


def test_at_most_one_constraint():
    with pytest.raises(SamplingParamsError, match="json_schema and regex"):
        SamplingParams(json_schema="{}", regex="a").validate()
    with pytest.raises(SamplingParamsError, match="ebnf"):
        SamplingParams(ebnf="").validate()
    SamplingParams(ebnf='root ::= "a"').validate()
    assert SamplingParams.from_any({"regex": "a", "logit_bias": {"1": 2}}).regex == "a"


def test_logprobs_under_a_grammar_are_floored_not_infinite():
    v = len(VOCAB)
    req = _req(grammar=_grammar("1|2"), temperature=0.0)
    req.return_logprob, req.top_logprobs_num = True, 4
    out = Sampler(v, [EOS])(torch.randn(1, v), [req])
    vals = [lp for lp, _ in out.top_logprobs[0]]
    assert vals[2:] == [-9999.0, -9999.0] and all(x > -9999.0 for x in vals[:2]) and out.logprobs[0] > -9999.0
    # the two allowed tokens share the whole mass
    assert abs(sum(torch.tensor(vals[:2]).exp().tolist()) - 1) < 1e-5


def test_bitmask_device_buffer_does_not_grow_for_a_steady_batch():
    """The device rows are reused at a steady batch size (the H200 benchmark, passing device "cuda" for
    a buffer on cuda:0, once doubled them every step until an allocation of 148 GiB failed); they grow
    geometrically past the batch size."""
    from hybridmoe.engine.grammar_mask import BatchBitmask

    bm = BatchBitmask(vocab_size=1000)
    for _ in range(40):
        rows = bm._device_rows(4, torch.device("cpu"))
    assert rows.shape == (4, 32) and bm._dev.shape[0] == 4
    bm._device_rows(5, torch.device("cpu"))
    assert bm._dev.shape[0] == 8
    for _ in range(10):
        bm._device_rows(3, torch.device("cpu"))
    assert bm._dev.shape[0] == 8
