"""The edits a participant makes first, made here as a participant makes them (a subclass or a module swapped
in, never a list of the baseline's parameters): each lands in a few places and the kit's rules follow it. A
tied head gets the head's init, is counted as the matmul it is, and has one row in the table; a second head
gets the head's init; a branch's output projection starts at zero whatever its name or place; a vector in a
block needs one row; grouped-query attention is a flag."""
from __future__ import annotations

import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from helpers import REPO, every_ingredient, flags_for

sys.path.insert(0, str(REPO))
import train as T  # noqa: E402

VOCAB = 512
SHAPE = ["--depth", "2", "--aspect-ratio", "64", "--head-dim", "32", "--seq-len", "16"]


def config(*argv) -> T.GPTConfig:
    return T.model_config(T.parse_command_line([*SHAPE, *argv])[0], vocab_size=VOCAB)


class TiedHead(T.GPT):
    """nanochat's tied embeddings: the head multiplies by the token embedding's table."""

    def __init__(self, config):
        super().__init__(config)
        self.lm_head.weight = self.wte.weight


class SecondHead(T.GPT):
    """Multi-token prediction: a second head predicts the token after next from the same hidden state."""

    def __init__(self, config):
        super().__init__(config)
        self.t_plus_2 = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, idx, targets=None, positions=None, attn_mask=None):
        if targets is None:
            return super().forward(idx, positions=positions, attn_mask=attn_mask)
        hidden = {}
        handle = self.lm_head.register_forward_hook(lambda m, args, out: hidden.update(x=args[0]))
        loss = super().forward(idx, targets)
        handle.remove()
        logits = self.t_plus_2(hidden["x"])
        return loss + T.training_loss(logits[:, :-1], targets[:, 1:], self.config.logit_softcap)


class SwiGLU(nn.Module):
    """An MLP whose output projection has a name of its own (w_out, not c_proj), declared first."""

    def __init__(self, config):
        super().__init__()
        self.w_out = nn.Linear(2 * config.n_embd, config.n_embd, bias=False)
        self.w_gate = nn.Linear(config.n_embd, 2 * config.n_embd, bias=False)
        self.w_up = nn.Linear(config.n_embd, 2 * config.n_embd, bias=False)

    def forward(self, x):
        return self.w_out(F.silu(self.w_gate(x)) * self.w_up(x))


class InputGain(T.CausalSelfAttention):
    """A learned gain on the attention's input (a norm's weight): a vector in a block."""

    def __init__(self, config, value_embed=False):
        super().__init__(config, value_embed)
        self.gain = nn.Parameter(torch.ones(config.n_embd))

    def forward(self, x, *args, **kwargs):
        return super().forward(x * self.gain, *args, **kwargs)


def built(kind=T.GPT, *argv) -> T.GPT:
    torch.manual_seed(0)
    model = kind(config(*argv))
    model.init_weights()
    return model


def test_a_tied_head_gets_the_heads_init_and_starts_where_an_untied_one_does():
    """The rule names the winner: the head's std 0.001 (the forward norms the embedding). A unit-normal head would
    start at about twice the loss of uniform guessing."""
    model = built(TiedHead)
    assert model.lm_head.weight is model.wte.weight and 0.0005 < model.wte.weight.std() < 0.002
    idx = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(1))
    assert model(idx[:, :-1], idx[:, 1:]) < 1.05 * built()(idx[:, :-1], idx[:, 1:])


def test_a_second_head_gets_the_heads_init():
    head = built(SecondHead).t_plus_2.weight
    assert 0.0005 < head.std() < 0.002


def test_a_branch_writes_to_the_residual_stream_from_zero_whatever_its_names(monkeypatch):
    monkeypatch.setattr(T, "MLP", SwiGLU)
    model = built()
    for block in model.blocks:
        assert not block.mlp.w_out.weight.any() and not block.attn.c_proj.weight.any()
        assert block.mlp.w_gate.weight.std() > 0.01 and block.mlp.w_up.weight.std() > 0.01
    assert T.forward_on_meta(model.config).writers == {f"blocks.{i}.{part}" for i in range(2)
                                                       for part in ("attn.c_proj", "mlp.w_out")}


def matmul_flops_per_token(model: T.GPT, tokens: int = 16) -> float:
    """What torch's FlopCounterMode counts in a training forward and backward, per token: every matmul (on a
    CPU it leaves attention out, which the kit counts by its formula)."""
    idx = torch.randint(0, VOCAB, (1, tokens + 1), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        model(idx[:, :-1], idx[:, 1:]).backward()
    return counter.get_total_flops() / tokens


@pytest.mark.parametrize("kind, argv", [(T.GPT, ()), (TiedHead, ()), (SecondHead, ()), (InputGain, ()),
                                        (T.GPT, ("--n-kv-head", "1", *flags_for(every_ingredient())))])
def test_the_flops_count_is_what_a_training_step_multiplies(monkeypatch, kind, argv):
    """6 per weight of each matmul the step runs, however it is declared (a tied head included, lookups not),
    plus attention by its formula over each layer's context; vectors count 6 per weight, the kit's convention."""
    if kind is InputGain:
        monkeypatch.setattr(T, "CausalSelfAttention", InputGain)
        kind = T.GPT
    model = built(kind, *argv)
    c = model.config
    attention = 12 * c.n_embd * sum(min(w or c.sequence_len, c.sequence_len) for w in c.windows)
    vectors = sum(p.numel() for p in model.parameters() if p.dim() < 2)
    assert model.flops_per_token() == matmul_flops_per_token(model) + attention + 6 * vectors


def test_a_parameter_in_two_rows_is_the_tables_error_naming_it(monkeypatch):
    """Tied, the head's weight is the embedding's: a row for the head besides the embedding's is one too many."""
    kit_table = T.parameter_table

    def with_a_head_row(model, recipe, ns_dtype):  # as the kit ships it, or again after a tied edit dropped it
        rule = dict(kind="adamw", lr=recipe.unembedding_lr, betas=(0.8, 0.95), eps=1e-10, weight_decay=0.0)
        return kit_table(model, recipe, ns_dtype) + [([model.lm_head.weight], rule)]

    monkeypatch.setattr(T, "parameter_table", with_a_head_row)
    recipe = T.Recipe()
    model = built(TiedHead)
    head_lr = recipe.unembedding_lr  # the row kept: the head's rate (at the embedding's, a tied head diverges)
    rows = [r for r, (params, _) in enumerate(with_a_head_row(model, recipe, None))
            if any(p is model.lm_head.weight for p in params)]
    with pytest.raises(ValueError, match=r"parameters \['wte.weight = lm_head.weight \(rows 0 at lr .*, "
                                         rf"{rows[-1]} at lr {head_lr:.3g}: keep row {rows[-1]}\)'\] are in more "
                                         r"than one row of parameter_table: keep the row with the lowest learning rate"):
        T.build_optimizer(model, recipe, compiled=False)


def test_a_vector_in_a_block_is_named_and_one_row_is_enough(monkeypatch):
    """The Muon row takes the blocks' matrices only, so a vector there is the table's error until it has a row."""
    monkeypatch.setattr(T, "CausalSelfAttention", InputGain)
    model = built()
    with pytest.raises(ValueError, match=r"parameters \['blocks.0.attn.gain', 'blocks.1.attn.gain'\] have no row in "
                                         r"parameter_table: add one"):
        T.parameter_groups(model, T.Recipe())
    kit_table = T.parameter_table

    def with_its_row(model, recipe, ns_dtype):
        rule = dict(kind="adamw", lr=recipe.scalar_lr * 0.01, betas=(0.8, 0.95), eps=1e-10, weight_decay=0.0)
        return kit_table(model, recipe, ns_dtype) + [([b.attn.gain for b in model.blocks], rule)]

    monkeypatch.setattr(T, "parameter_table", with_its_row)
    optimizer = T.build_optimizer(model, T.Recipe(), compiled=False)
    gains = {id(b.attn.gain) for b in model.blocks}
    assert [g["kind"] for g in optimizer.param_groups if gains & {id(p) for p in g["params"]}] == ["adamw"]
    idx = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(1))
    model(idx[:, :-1], idx[:, 1:]).backward()
    optimizer.step()


def test_grouped_query_attention_is_a_flag_and_value_embeddings_follow_the_keys_and_values():
    model = built(T.GPT, "--n-kv-head", "2", "--value-embeds", "alternate")
    c = model.config
    head_dim = c.n_embd // c.n_head
    assert (c.n_head, c.n_kv_head) == (4, 2) and c.kv_width == 2 * head_dim
    assert model.blocks[1].attn.c_k.weight.shape == model.blocks[1].attn.c_v.weight.shape == (c.kv_width, c.n_embd)
    assert model.value_embeds["1"].weight.shape == (VOCAB, c.kv_width)
    assert model.blocks[1].attn.ve_gate.weight.shape[0] == c.n_kv_head
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    idx = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(2))
    changed = idx.clone()
    changed[:, 9:] = 0
    with torch.no_grad():
        assert torch.equal(model(changed)[:, :9], model(idx)[:, :9])  # causal
    T.parameter_groups(model, T.Recipe())  # the table's rows follow the new shapes
    with pytest.raises(ValueError, match=r"--n-kv-head 3: must divide the 4 query heads \(width / --head-dim\): 1, 2, 4"):
        config("--n-kv-head", "3")


# --- The documented edits, made to a copy of the kit as a participant makes them, and the suite run on it ------------
# Each edit is the text it replaces in train.py and the text it puts there, place by place (docs/train-py.md, "Where
# an edit goes", counts them). An edit that no longer applies fails here: update it and the docs together.
SCALAR_ROW = "        ([model.resid_lambdas], dict(adamw, lr=recipe.scalar_lr * 0.01)),\n"
DOCUMENTED_EDITS = {
    "z-loss": [  # an auxiliary term in the loss
        ("    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))\n",
         "    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1)) + \\\n"
         "        1e-4 * torch.logsumexp(logits, dim=-1).square().mean()\n")],
    "tied-head": [  # nanochat's tied embeddings: the tie, and one of the two rows dropped (the head's rate kept)
        ("        self.lm_head = nn.Linear(C, V, bias=False)\n",
         "        self.lm_head = nn.Linear(C, V, bias=False)\n        self.lm_head.weight = self.wte.weight\n"),
        ("        ([model.wte.weight], dict(adamw, lr=recipe.embedding_lr * width_scale)),\n", "")],
    "second-head": [  # multi-token prediction: a head for t+2, its loss term where the hidden state is, its row
        ("        self.lm_head = nn.Linear(C, V, bias=False)\n",
         "        self.lm_head = nn.Linear(C, V, bias=False)\n        self.next_next = nn.Linear(C, V, bias=False)\n"),
        ("            logits = self.lm_head(norm(x))\n        cap = self.config.logit_softcap\n"
         "        if targets is not None:\n            return training_loss(logits, targets, cap)\n",
         "            logits = self.lm_head(norm(x))\n            after_next = self.next_next(norm(x))\n"
         "        cap = self.config.logit_softcap\n        if targets is not None:\n"
         "            return training_loss(logits, targets, cap) + training_loss(after_next[:, :-1], targets[:, 1:], "
         "cap)\n"),
        ("        ([model.lm_head.weight], dict(adamw, lr=recipe.unembedding_lr * width_scale)),\n",
         "        ([model.lm_head.weight], dict(adamw, lr=recipe.unembedding_lr * width_scale)),\n"
         "        ([model.next_next.weight], dict(adamw, lr=recipe.unembedding_lr * width_scale)),\n")],
    "head-temperature": [  # a learned temperature per head: a vector in a block, and its row
        ("        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=False)\n",
         "        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=False)\n"
         "        self.temperature = nn.Parameter(torch.ones(self.n_head))\n"),
        ("        q, k = rope_qknorm(q, cos, sin), rope_qknorm(k, cos, sin)\n",
         "        q, k = rope_qknorm(q, cos, sin), rope_qknorm(k, cos, sin)\n"
         "        q = q * self.temperature.view(1, 1, -1, 1).to(q.dtype)\n"),
        (SCALAR_ROW, SCALAR_ROW + "        ([b.attn.temperature for b in model.blocks], "
                                  "dict(adamw, lr=recipe.scalar_lr * 0.01)),\n")],
    "head-temperature-flag": [  # the same behind an ingredient flag, --head-temperature
        ("    short_window: int = 0",
         "    head_temperature: bool = ingredient(False, on=True)  # a learned temperature per head\n"
         "    short_window: int = 0"),
        ("        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=False)\n",
         "        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=False)\n"
         "        self.temperature = nn.Parameter(torch.ones(self.n_head)) if config.head_temperature else None\n"),
        ("        q, k = rope_qknorm(q, cos, sin), rope_qknorm(k, cos, sin)\n",
         "        q, k = rope_qknorm(q, cos, sin), rope_qknorm(k, cos, sin)\n        if self.temperature is not None:\n"
         "            q = q * self.temperature.view(1, 1, -1, 1).to(q.dtype)\n"),
        (SCALAR_ROW, SCALAR_ROW + "        ([b.attn.temperature for b in model.blocks if b.attn.temperature is not "
                                  "None], dict(adamw, lr=recipe.scalar_lr * 0.01)),\n")],
    "swiglu": [  # SwiGLU as Llama writes it (w2 the output)
        ("        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=False)\n"
         "        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=False)\n",
         "        hidden = 8 * config.n_embd // 3\n        self.w1 = nn.Linear(config.n_embd, hidden, bias=False)\n"
         "        self.w2 = nn.Linear(hidden, config.n_embd, bias=False)\n"
         "        self.w3 = nn.Linear(config.n_embd, hidden, bias=False)\n"),
        ("        return self.c_proj(relu_squared(self.c_fc(x)))\n",
         "        return self.w2(F.silu(self.w1(x)) * self.w3(x))\n")],
    "cosine-warmdown": [  # a schedule of another shape
        ("    cooldown = max(0.0, (1.0 - progress) / recipe.warmdown_ratio)\n",
         "    cooldown = 0.5 * (1 + math.cos(math.pi * min(1.0, (progress - 1 + recipe.warmdown_ratio) / "
         "recipe.warmdown_ratio)))\n")],
}
# The tests that read what each edit changes (the model and its loss, the optimizer's table, the schedules, the
# planner's counts, whether a tiny model still learns): whole modules, or single tests of test_train.py (its module
# is mostly the run's machinery). Their slow tests stay out.
LEARNS = "test_train.py::test_tiny_model_learns_well_below_unigram_entropy"
AFFECTED_TESTS = {
    "z-loss": ["test_model.py", "test_kernels.py", LEARNS],
    "tied-head": ["test_model.py", "test_edits.py", "test_optimizer.py", "test_plan.py"],
    "second-head": ["test_model.py", "test_edits.py", "test_optimizer.py", "test_plan.py"],
    "head-temperature": ["test_model.py", "test_edits.py", "test_optimizer.py", "test_ingredients.py"],
    "head-temperature-flag": ["test_model.py", "test_optimizer.py", "test_ingredients.py",
                              "test_train.py::test_flags_cover_the_recipe_and_the_run_options_and_presets_apply"],
    "swiglu": ["test_model.py", "test_edits.py", "test_plan.py", "test_ingredients.py"],
    "cosine-warmdown": ["test_train.py::test_schedules", LEARNS],
}


def edited_kit(folder, edit: str):
    """A copy of the kit's code and tests with `edit` made to train.py, place by place."""
    import shutil
    for name in ("train.py", "prepare.py", "inference.py", "pytest.ini"):
        shutil.copy(REPO / name, folder / name)
    for name in ("harness", "kernels", "tests", "tokenizer", "tools"):
        shutil.copytree(REPO / name, folder / name, ignore=shutil.ignore_patterns("__pycache__"))
    source = (folder / "train.py").read_text()
    for old, new in DOCUMENTED_EDITS[edit]:
        assert source.count(old) == 1, f"the documented edit {edit!r} no longer applies: {old.strip()[:60]!r}"
        source = source.replace(old, new)
    (folder / "train.py").write_text(source)
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("edit", sorted(DOCUMENTED_EDITS))
def test_a_documented_edit_leaves_the_suite_green(tmp_path, edit):
    """The suite checks the kit, not the baseline's numbers: after each documented edit the tests that read what
    it changes pass (their inner loop: -m "not slow")."""
    import os
    import subprocess
    kit = edited_kit(tmp_path, edit)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}  # its own run, not this worker's
    modules = [f"tests/{m}" for m in AFFECTED_TESTS[edit]]
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-m", "not slow", "-p", "no:cacheprovider",
                             "--basetemp", str(tmp_path / "pytest"), *modules],
                            cwd=kit, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"{edit}:\n{result.stdout[-4000:]}{result.stderr[-2000:]}"
