"""Paged KV through block tables: reused cache == cold prefill; block
accounting; the prefix cache never serves blocks of other tokens."""

import pytest
import torch

from completer.engine import block_manager
from completer.engine.attention import AttentionMetadata, TorchAttention
from completer.engine.block_manager import BlockManager, OutOfBlocks
from completer.engine.paged_kv import KVPool
from support.tiny import tiny_config, tiny_model

CFG = tiny_config(vocab_size=97)
BS = 4


@pytest.fixture(scope="module")
def model():
    return tiny_model(CFG, scale=0.2)


def prefill(model, pool, manager, tokens, chunk=None):
    """Match cached blocks, compute the rest (in chunks), publish; returns
    (table, cached tokens, logits of the computed tokens)."""
    table, chain = manager.match_prefix(tokens)
    done = cached = len(table) * BS
    manager.grow(table, len(tokens))
    outs = []
    while done < len(tokens):
        n = min(chunk or len(tokens), len(tokens) - done)
        meta = AttentionMetadata.build([table], [done], [n], BS)
        with torch.no_grad():
            outs.append(model(torch.tensor([tokens[done: done + n]]), meta.positions, TorchAttention(pool, meta)))
        done += n
        manager.publish(table, chain, tokens, done)
    return table, cached, torch.cat(outs, dim=1)


def test_reused_cache_gives_cold_logits(model):
    pool, manager = KVPool(CFG, 64, BS), BlockManager(64, BS)
    torch.manual_seed(1)
    first = torch.randint(0, 97, (30,)).tolist()
    table, cached, _ = prefill(model, pool, manager, first, chunk=7)
    assert cached == 0
    manager.release(table)
    second = first[:27] + torch.randint(0, 97, (9,)).tolist()  # an edit near the end
    table, cached, logits = prefill(model, pool, manager, second)
    assert cached == 24  # 6 full blocks of the shared 27 tokens
    with torch.no_grad():
        cold = model(torch.tensor([second]))[:, cached:]
    # Stated tolerance: fp32, different reduction orders.
    assert (logits - cold).abs().max() <= 1e-5


def test_batched_decode_matches_single(model):
    pool, manager = KVPool(CFG, 64, BS), BlockManager(64, BS, prefix_cache=False)
    torch.manual_seed(2)
    prompts = [torch.randint(0, 97, (n,)).tolist() for n in (5, 13, 8)]
    tables = [prefill(model, pool, manager, p)[0] for p in prompts]
    nxt = [11, 22, 33]
    for t, p in zip(tables, prompts):
        manager.grow(t, len(p) + 1)
    meta = AttentionMetadata.build(tables, [len(p) for p in prompts], [1, 1, 1], BS)
    with torch.no_grad():
        got = model(torch.tensor([[x] for x in nxt]), meta.positions, TorchAttention(pool, meta))
        for b, p in enumerate(prompts):
            want = model(torch.tensor([p + [nxt[b]]]))[:, -1]
            assert (got[b, -1] - want).abs().max() <= 1e-5


def test_release_returns_every_block_and_lru_eviction():
    manager = BlockManager(9, BS)  # 8 usable blocks
    a = list(range(100, 117))  # 17 tokens -> 5 blocks
    ta, chain = manager.match_prefix(a)
    manager.grow(ta, len(a))
    manager.publish(ta, chain, a, len(a))
    assert manager.num_free == 3
    manager.release(ta)
    assert manager.num_free == 8 and manager.num_cached_free == 4
    assert all(c == 0 for c in manager.ref_count)
    # A different prompt needing 6 blocks recycles never-used ones first, then the
    # cached leaves; the shared root of `a` survives longest.
    b = list(range(200, 221))
    tb, _ = manager.match_prefix(b)
    manager.grow(tb, len(b))
    assert manager.num_cached_free == 2
    assert manager.match_prefix(a)[0] == ta[:2]
    with pytest.raises(OutOfBlocks):
        manager.grow(tb, len(b) + 5 * BS)


def test_a_digest_collision_never_serves_other_tokens(monkeypatch):
    """Every key hashes alike: a lookup finds a block published under another
    key and must refuse it (the cache then starts cold), not serve its K/V."""
    monkeypatch.setattr(block_manager, "block_digest", lambda key: 42)
    manager = BlockManager(16, BS)
    a = list(range(100, 109))
    ta, chain = manager.match_prefix(a)
    manager.grow(ta, len(a))
    manager.publish(ta, chain, a, len(a))
    assert len(chain) == 1  # the first block is published; the second's digest is taken
    manager.release(ta)
    b = list(range(200, 209))  # other tokens, the same digest
    assert manager.match_prefix(b) == ([], [])
    assert manager.match_prefix(a)[0] == ta[:1]  # the right tokens still match



def test_prompts_under_different_salts_never_share_blocks():
    """A shared cache lets one user time whether another's prompt starts with a
    guess (cached_tokens 416 vs 64); a salt per user or session closes that."""
    manager = BlockManager(32, BS)
    tokens = list(range(100, 100 + 5 * BS + 1))
    table, chain = manager.match_prefix(tokens, salt="alice")
    manager.grow(table, len(tokens))
    manager.publish(table, chain, tokens, len(tokens), salt="alice")
    manager.release(table)
    for salt in ("bob", ""):
        assert manager.match_prefix(tokens, salt=salt) == ([], [])
    again, _ = manager.match_prefix(tokens, salt="alice")
    assert again == table[:5]
