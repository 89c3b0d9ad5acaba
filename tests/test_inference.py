"""inference.py's prefix cache: grouping, packing, equality with the plain scorer (fp32 and bf16),
the fallback for other models, and the harness's verification of the cached scorer end to end."""
from __future__ import annotations

import json
import random

import pytest
import torch

import inference as I
import train as T
from core_bundle import make_bundle
from harness.core.bundle import bundle_from_dir, load_examples, load_tasks
from harness.core.prompts import build_request, shuffled_and_capped
from helpers import REPO, every_ingredient, prepare_in_process, shipped_tokenizer

VOCAB = 512


# Every ingredient of the recipe on at once: value embeddings, and a short window that counts distances by
# position.
EVERY_INGREDIENT = dict(n_layer=3, **every_ingredient(), short_window=24)


def tiny_gpt(dtype="fp32", seed=0, **ingredients) -> T.GPT:
    """A 2-layer GPT whose every weight matters: init_weights zeroes the output projections (each
    block starts as the identity), so all weights are perturbed, and the x0 mix is made uneven."""
    torch.manual_seed(seed)
    config = T.GPTConfig(**{**dict(sequence_len=128, vocab_size=VOCAB, n_layer=2, n_head=2, n_embd=64),
                            **ingredients})
    model = T.build_model(config, dtype=dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
        model.lm_head.weight.mul_(10)  # logits spread as a trained model's (std ~4)
    return model.eval().requires_grad_(False)


def core_like_sequences(seed=0, examples=12) -> list[list[int]]:
    """Examples in CORE's shape, shuffled together: a long few-shot prefix and 1-5 choices each (one
    choice sometimes a strict prefix of another), plus two examples that share their first shot."""
    rng = random.Random(seed)
    words = lambda n: [rng.randrange(1, VOCAB) for _ in range(n)]  # noqa: E731
    shot = words(40)
    sequences = []
    for e in range(examples):
        prefix = [0] + (shot if e < 2 else words(rng.randrange(10, 60))) + words(rng.randrange(5, 120))
        choices = [words(rng.randrange(1, 25)) for _ in range(rng.randrange(1, 6))]
        if len(choices) > 2 and len(choices[0]) > 2:
            choices[1] = choices[0][:2]
        sequences += [prefix + c for c in choices]
    sequences += [[0] + words(rng.randrange(1, 90)) for _ in range(4)]  # lone sequences
    rng.shuffle(sequences)
    return sequences


def top2_margins(model, sequences) -> list[torch.Tensor]:
    """The plain model's gap between its best and second-best logit at each scored position."""
    x = torch.zeros(len(sequences), max(len(s) for s in sequences), dtype=torch.long)
    for r, seq in enumerate(sequences):
        x[r, :len(seq)] = torch.tensor(seq)  # right padding: a causal model's positions never see it
    top = model(x).topk(2, dim=-1).values
    return [top[r, :len(seq) - 1, 0] - top[r, :len(seq) - 1, 1] for r, seq in enumerate(sequences)]


# --- grouping and packing ------------------------------------------------------------------------

def test_prefix_groups_pack_the_choices_of_each_example():
    a, b = list(range(100, 130)), list(range(200, 240))
    other = a[:18] + list(range(300, 342))  # shares 18 tokens with example a: not worth shrinking its prefix
    seqs = [a + [1, 2], b + [5], a + [3], other, b + [6, 7, 8], a + [4, 4, 4], list(range(20)) + [9], b]
    groups = {tuple(sorted(m)): shared for shared, m in I.prefix_groups(seqs)}
    assert groups == {(0, 2, 5): 30, (1, 4, 7): 39, (3,): len(other) - 1, (6,): 20}
    assert I.prefix_groups([a[:12] + [1], a[:12] + [2]]) == [(12, [0]), (12, [1])]  # under MIN_SHARED_PREFIX
    assert len(I.prefix_groups([a + [1, 2], a + [3, 4]], max_row=31)) == 2  # the row would be too long
    tokens, positions, segments, where = I.pack_group([[7, 8, 9, 1, 2], [7, 8, 9, 3], [7, 8, 9]], 2, [0, 1, 2])
    assert tokens == [7, 8, 9, 1, 9] and positions == [0, 1, 2, 3, 2]  # last tokens are only targets
    assert segments == [0, 0, 1, 1, 2] and where == [[0, 1, 2, 3], [0, 1, 4], [0, 1]]
    mask = I.packed_mask(torch.tensor([segments + [-1]]))[0, 0].int()
    assert mask[3].tolist() == [1, 1, 1, 1, 0, 0]  # the first member's last input: the prefix and its own
    assert mask[4].tolist() == [1, 1, 0, 0, 1, 0]  # the second member's: never the first member's tokens
    assert mask[5].tolist() == [1, 1, 0, 0, 0, 1]  # padding: the prefix and itself, never an empty row


# --- equality with the plain scorer ----------------------------------------------------------------

@pytest.mark.parametrize("ingredients", [{}, EVERY_INGREDIENT], ids=["baseline", "every-ingredient"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_prefix_cached_scores_equal_the_plain_scorer(dtype, ingredients, monkeypatch, capsys):
    monkeypatch.setattr(I, "MAX_BATCH_TOKENS", 1024)  # several batches,
    monkeypatch.setattr(I, "STATIC_ROW_DEVICES", ("cpu",))  # and a last one padded with rows, as on Neuron
    model = tiny_gpt(dtype, **ingredients)
    sequences = core_like_sequences()
    plain, cached = I.Scorer(model, torch.device("cpu"), prefix_cache=False), I.Scorer(model, torch.device("cpu"))
    assert cached.prefix_cache and "prefix cache off" not in capsys.readouterr().err
    groups = I.prefix_groups(sequences)
    assert sum(len(m) > 1 for _, m in groups) >= 10 and any(s >= 80 for s, m in groups if len(m) > 1)
    expected, got = plain.score(sequences), cached.score(sequences)
    assert cached.tokens_run < 0.6 * plain.tokens_run  # the prefixes really were computed once
    tolerance, near_tie = (1e-5, 1e-4) if dtype == "fp32" else (0.02, 0.05)
    compared = 0
    for (losses, greedy), (want_losses, want_greedy), margin, seq in zip(got, expected, top2_margins(model, sequences),
                                                                          sequences):
        assert losses.shape == greedy.shape == (len(seq) - 1,)
        torch.testing.assert_close(losses, want_losses, atol=tolerance, rtol=1e-6)
        clear = margin > near_tie
        assert torch.equal(greedy[clear], want_greedy[clear])
        compared += int(clear.sum())
    assert compared > 0.8 * sum(len(s) - 1 for s in sequences)
    assert [tuple(losses.shape) for losses, _ in cached.score([[5], [5, 6]])] == [(0,), (1,)]
    with pytest.raises(ValueError, match="exceeds the rotary tables"):
        cached.score([[1] * (model.cos.shape[1] + 2)])


def test_a_model_without_the_pieces_is_scored_in_full(capsys):
    class Bigram(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(VOCAB, VOCAB)
            self.register_buffer("cos", torch.zeros(1, 256, 1, 8))

        def forward(self, idx):
            return self.emb(idx)

    torch.manual_seed(0)
    scorer = I.Scorer(Bigram().eval(), torch.device("cpu"))
    err = capsys.readouterr().err
    assert not scorer.prefix_cache and err.count("prefix cache off") == 1
    assert "the model's forward takes no positions or attn_mask" in err
    sequences = core_like_sequences(examples=3)
    for (a, g), (b, h) in zip(scorer.score(sequences), scorer.score_plain(sequences)):
        assert torch.equal(a, b) and torch.equal(g, h)
    assert "prefix cache off" not in capsys.readouterr().err  # said once, at load


def test_a_changed_forward_turns_the_cache_off(capsys):
    """A model whose forward takes positions and a mask but does not honour them (here: a logit bias by
    index in the row, as an absolute position embedding that ignores `positions` adds) is caught by the
    load-time probe and scored in full."""
    class Shifted(T.GPT):
        def forward(self, idx, targets=None, positions=None, attn_mask=None):
            logits = super().forward(idx, positions=positions, attn_mask=attn_mask)
            return logits + 0.1 * torch.arange(idx.shape[1])[:, None] * torch.linspace(-1, 1, logits.shape[-1])

    model = tiny_gpt()
    changed = Shifted(model.config)
    changed.load_state_dict(model.state_dict())
    scorer = I.Scorer(changed.eval(), torch.device("cpu"))
    err = capsys.readouterr().err
    assert not scorer.prefix_cache and "differ from model(x)'s" in err and "does not honour positions" in err
    assert I.Scorer(model, torch.device("cpu")).prefix_cache  # the same weights in the kit's GPT: on


# --- the harness verifies the cached scorer --------------------------------------------------------

@pytest.mark.slow
def test_eval_core_verifies_the_prefix_cached_scorer(tmp_path, text_dataset, tiny_checkpoint, capsys):
    bundle = make_bundle(tmp_path)
    scorer = I.load_scorer(str(tiny_checkpoint), torch.device("cpu"))
    assert scorer.prefix_cache, capsys.readouterr().err
    loaded = bundle_from_dir(bundle)
    tokenizer, grouped = shipped_tokenizer(), 0
    for task in load_tasks(loaded):  # the bundle's own requests: some share prefixes, and score the same
        data = shuffled_and_capped(load_examples(loaded, task), -1)
        sequences = [s for i in range(len(data))
                     for s in build_request(task, data, i, tokenizer, scorer.max_seq_len).sequences]
        grouped += sum(len(m) > 1 for _, m in I.prefix_groups(sequences))
        for (a, g), (b, h) in zip(scorer.score(sequences), scorer.score_plain(sequences)):
            torch.testing.assert_close(a, b, atol=1e-3, rtol=0)
            assert (g == h).float().mean() > 0.95
    assert grouped >= 10
    result = prepare_in_process(["eval-core", "--inference-py", str(REPO / "inference.py"), "--checkpoint",
                                 str(tiny_checkpoint), "--bundle-dir", str(bundle), "--verify-fraction", "1",
                                 "--report", str(tmp_path / "r.json")], {"FRONTIER_DATA_DIR": str(text_dataset)})
    assert result.returncode == 0, result.stderr
    assert "prefix cache off" not in result.stderr
    verify = json.loads((tmp_path / "r.json").read_text())["verify"]
    assert verify["examples"] == 37 and verify["max_abs_loss_diff"] < 1e-3 and verify["max_greedy_gap"] < 1e-3
    assert verify["decisions_flipped_within_allowance"] == 0 and verify["max_causal_diff"] <= 1e-3
    assert verify["max_token_loss_diff"] < 1e-3  # every example verified (--verify-fraction 1): nothing hides
    assert verify["coverage"]["bound"] == 0  # every example verified and decided by the trusted path: nothing pays
    assert "verify_coverage:     at a 50% chance of refusal a forger gains at most CORE +0.0000" in result.stdout
    assert "verified examples decided by the trusted path" in result.stdout
