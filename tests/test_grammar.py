"""engine/grammar.py and grammar_mask.py: compile cache, compile errors, matcher termination, and the batch
bitmask against a brute-force reference (every token tried on a fork of the matcher)."""

from __future__ import annotations

import threading

import pytest
import torch
import xgrammar as xgr

from hybridmoe.engine.grammar import (
    GrammarBackend,
    GrammarError,
    RequestGrammar,
    compiler_message,
    drop_inner_anchors,
    grammar_of,
)
from hybridmoe.engine.grammar_mask import BatchBitmask, apply_bitmask_reference
from hybridmoe.engine.request import SamplingParams

VOCAB = ["a", "b", "c", "ab", "{", "}", '"', "x", " ", ":", "1", "2", "12", "<eos>"]
EOS = len(VOCAB) - 1


def _backend(**kw) -> GrammarBackend:
    return GrammarBackend.for_vocab(VOCAB, [EOS], **kw)


def _ids(*tokens: str) -> list[int]:
    return [VOCAB.index(t) for t in tokens]


def test_grammar_of_picks_the_constraint():
    assert grammar_of(SamplingParams()) is None
    assert grammar_of(SamplingParams(regex="a+")) == ("regex", "a+")
    assert grammar_of(SamplingParams(ebnf='root ::= "a"')) == ("ebnf", 'root ::= "a"')
    assert grammar_of(SamplingParams(json_schema="{}")) == ("json_schema", "{}")


def test_cache_by_content_and_lru_bound():
    be = _backend(cache_entries=2)
    g1 = be.compile("regex", "a+")
    assert be.compile("regex", "a+") is g1 and be.compiles == 1  # same text: the cached grammar
    be.compile("ebnf", 'root ::= "b"')
    assert be.compiles == 2 and len(be) == 2
    be.compile("regex", "a+")  # a+ is now the most recent
    be.compile("regex", "c")  # evicts the least recent: the ebnf one
    assert len(be) == 2 and be.cached("regex", "a+") and be.cached("regex", "c")
    assert not be.cached("ebnf", 'root ::= "b"')
    assert be.compile("regex", "a+") is g1 and be.compiles == 3
    be.close()


def test_cache_bound_in_bytes_keeps_the_newest():
    be = _backend(cache_bytes=1)  # every grammar is larger: only the newest stays
    be.compile("regex", "a+")
    be.compile("regex", "b+")
    assert len(be) == 1 and be.cached("regex", "b+")
    be.close()


def test_concurrent_compiles_of_one_text_run_once():
    be = _backend()
    results: list[object] = []
    barrier = threading.Barrier(4)

    def work() -> None:
        barrier.wait()
        results.append(be.compile("json_schema", '{"type": "object", "properties": {"a": {"type": "integer"}}}'))

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 4 and all(r is results[0] for r in results) and be.compiles == 1
    be.close()


@pytest.mark.parametrize("kind,text,words", [
    ("regex", "a(b", ["regex", "parenthesis"]),
    ("ebnf", "root ::= foo", ["ebnf", 'rule "foo" is not defined']),
    ("ebnf", 'start ::= "a"', ["ebnf", "root"]),  # SGLang's semantics: the root rule is `root`
    ("json_schema", "not json", ["json_schema is not valid json"]),
    ("json_schema", '{"type": 3}', ["json_schema", "type"]),
])
def test_compile_errors_carry_the_compiler_message(kind, text, words):
    be = _backend()
    with pytest.raises(GrammarError) as info:
        be.compile(kind, text)
    message = str(info.value)
    assert all(w.lower() in message.lower() for w in words), message
    assert "/project/" not in message and not message.startswith("["), message  # xgrammar's log prefix gone
    assert len(be) == 0  # errors are not cached
    with pytest.raises(GrammarError):  # and through the backend's threads
        be.submit(kind, text).result(timeout=30)
    be.close()


def test_compiler_message_strips_prefixes():
    e = RuntimeError("[16:24:42] /project/cpp/x.cc:94: Check failed: (a) is false: bad thing\n")
    assert compiler_message(e) == "bad thing"


@pytest.mark.parametrize("regex,want", [
    ("^ab$", "^ab$"), ("a$b$c^d", "abcd"), ("^yes$|^no$", "^yes|no$"), ("(^a)", "(a)"), ("^^a$$", "^a$"),
    (r"a\$b\^", r"a\$b\^"), (r"a\\$", r"a\\$"), ("[$^]x", "[$^]x"), ("[^$]$", "[^$]$"), ("[a^$]b", "[a^$]b"),
    (r"[\]$]$b", r"[\]$]b"), ("", ""), ("$", "$"), ("^", "^"), ("abc", "abc"),
])
def test_drop_inner_anchors(regex, want):
    assert drop_inner_anchors(regex) == want


def _accepts(compiled, text: str) -> bool:
    m = xgr.GrammarMatcher(compiled)
    return m.accept_string(text) and m.is_completed()


def test_inner_anchors_compile_silently_to_what_xgrammar_made_of_them(capfd):
    """xgrammar ignores a ^ / $ that is not first / last, and printed a warning line to stderr for each (a
    JSON schema's pattern whole): the backend drops them first, so the same strings match and nothing is
    printed."""
    be = _backend()
    capfd.readouterr()
    regex = be.compile("regex", "^a$|^b$|a$b")
    schema = be.compile("json_schema", '{"type": "object", "properties": {"k": {"type": "string", '
                                       '"pattern": "x$y^z"}}, "required": ["k"]}')
    out, err = capfd.readouterr()
    assert "Warning" not in err and "Warning" not in out, err
    assert [_accepts(regex, t) for t in ("a", "b", "ab", "ba", "")] == [True, True, True, False, False]
    assert _accepts(schema, '{"k": "xyz"}') and not _accepts(schema, '{"k": "x$y^z"}')
    assert _accepts(be.compile("regex", "a$b"), "ab")
    assert str(xgr.Grammar.from_regex("a$b")) == str(xgr.Grammar.from_regex("ab"))  # xgrammar's own reading
    be.close()


def test_matcher_terminates_after_the_stop_token():
    be = _backend()
    g = RequestGrammar(be.compile("regex", "ab?c"))
    for t in _ids("a", "b", "c"):
        g.accept(t)
        assert not g.terminated
    with pytest.raises(GrammarError):  # nothing but a stop token after a complete match
        g.fork().accept(VOCAB.index("a"))
    g.accept(EOS)
    assert g.terminated
    be.close()


def test_matcher_refuses_a_token_outside_the_grammar_and_forks_independently():
    be = _backend()
    g = RequestGrammar(be.compile("regex", "(ab)+"))
    f = g.fork()
    g.accept(VOCAB.index("ab"))
    with pytest.raises(GrammarError):
        f.accept(VOCAB.index("b"))
    f.accept(VOCAB.index("a"))  # the fork was at the start still
    f.accept(VOCAB.index("b"))
    g.accept(EOS)
    assert g.terminated and not f.terminated
    be.close()


def _allowed_by_trying(g: RequestGrammar, vocab_size: int) -> set[int]:
    """Brute force: the tokens a fork of the matcher accepts."""
    return {t for t in range(vocab_size) if g.matcher.fork().accept_token(t)}


@pytest.mark.parametrize("padded_vocab", [len(VOCAB), 37, 64, 65])  # one word, odd sizes, exact words
def test_batch_bitmask_matches_brute_force_and_reference(padded_vocab):
    be = GrammarBackend.for_vocab(VOCAB, [EOS], vocab_size=padded_vocab)
    json_g = RequestGrammar(be.compile("json_schema", '{"type": "object", "properties": {"a": {"type": "integer"}},'
                                                      ' "required": ["a"]}'))
    regex_g = RequestGrammar(be.compile("regex", "(ab|c)+"))
    regex_g.accept(VOCAB.index("c"))  # mid-way: "c" then more, or the end
    grammars = [json_g, None, regex_g, None]
    bm = BatchBitmask(padded_vocab)
    mask = bm.fill(grammars, torch.device("cpu"))
    assert mask.shape == (4, (padded_vocab + 31) // 32) and mask.dtype == torch.int32
    for row, g in enumerate(grammars):
        bits = {t for t in range(padded_vocab) if (int(mask[row, t // 32]) >> (t % 32)) & 1}
        assert bits == (set(range(padded_vocab)) if g is None else _allowed_by_trying(g, padded_vocab)), row
    torch.manual_seed(padded_vocab)
    logits = torch.randn(4, padded_vocab)
    want = apply_bitmask_reference(logits, mask, padded_vocab)
    got = logits.clone()
    bm.apply(got, grammars)
    assert torch.equal(got, want)
    assert torch.equal(got[1], logits[1]) and torch.equal(got[3], logits[3])  # unconstrained rows untouched
    assert torch.isinf(got[0]).sum() > 0
    be.close()


@pytest.mark.parametrize("b,v", [(1, 1), (1, 33), (3, 100), (5, 257)])
def test_reference_matches_xgrammar_apply_on_random_masks(b, v):
    torch.manual_seed(b * 1000 + v)
    words = (v + 31) // 32
    mask = torch.randint(-(1 << 31), (1 << 31) - 1, (b, words), dtype=torch.int32)
    logits = torch.randn(b, v)
    got = logits.clone()
    xgr.apply_token_bitmask_inplace(got, mask, vocab_size=v)
    assert torch.equal(got, apply_bitmask_reference(logits, mask, v))


def test_bitmask_buffers_grow_and_alternate():
    be = _backend()
    g = RequestGrammar(be.compile("regex", "a"))
    bm = BatchBitmask(len(VOCAB))
    m1 = bm.fill([g], torch.device("cpu"))
    m2 = bm.fill([g, None, g], torch.device("cpu"))  # grows; the other buffer than m1's
    assert m2.data_ptr() != m1.data_ptr() and torch.equal(m2[0], m2[2]) and int(m2[1, 0]) == -1
    be.close()
