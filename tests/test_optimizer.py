"""train.py's optimizer: compiled vs eager update, per-step hyperparameters as device tensors,
gradient buckets and ZeRO-1 sharding across ranks, state-dict round trips."""
from __future__ import annotations

import copy
import sys

import pytest
import torch

from helpers import REPO

sys.path.insert(0, str(REPO))
import train as T  # noqa: E402

TINY = ["--depth", "2", "--aspect-ratio", "32", "--head-dim", "32", "--seq-len", "32"]


def tiny_model() -> T.GPT:
    torch.manual_seed(0)
    model = T.build_model(T.model_config(T.parse_command_line(TINY)[0]), dtype="fp32")
    return model


def set_gradients(model: T.GPT, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g) * 0.01


def hyperparameters(optimizer: T.MuonAdamW) -> list[list[float]]:
    return [[float(group[k]) for k in T.MuonAdamW.SCHEDULED if k in group] for group in optimizer.param_groups]


@pytest.mark.slow
def test_compiled_update_equals_eager_and_new_hyperparameters_do_not_recompile():
    torch._dynamo.reset()  # no graphs of the update from other tests in this process count towards its limit
    models, optimizers = [], []
    for mode in ("off", "on"):
        models.append(tiny_model())
        recipe, options, _ = T.parse_command_line(TINY)
        optimizers.append(T.build_optimizer(models[-1], recipe, options, ns_dtype=None, compile_backend="inductor",
                                            compiled=mode == "on"))
    eager, compiled = optimizers
    assert eager.optimizer._update is T.update_groups and compiled.optimizer._update is not T.update_groups
    for step in range(3):
        for model, optimizer in zip(models, optimizers):
            set_gradients(model, seed=step)
            T.apply_schedules(optimizer, 0.1 + 0.35 * step, recipe)  # new lr, momentum, weight decay every step
            # The first step compiles (never falling back to eager); after it, new hyperparameter
            # values and step counts are data.
            with torch._dynamo.config.patch(error_on_recompile=step > 0, fail_on_recompile_limit_hit=True):
                optimizer.step()
    initial = tiny_model().state_dict()
    for (name, a), b in zip(models[0].state_dict().items(), models[1].state_dict().values()):
        # fp32 rounding, except where an update at the rounding level flips Muon's cautious weight
        # decay (update * weight >= 0): there the two differ by one step's decay, lr * wd * |w| < 2% |w|.
        diff = (a - b).abs()
        flipped = diff > 1e-5 * a.abs() + 1e-6
        assert flipped.float().mean() < 1e-3 and (diff[flipped] <= 0.02 * a.abs()[flipped]).all(), name
        assert (a - initial[name]).abs().max() > 1e-3, name  # the steps moved it


def test_state_dict_round_trip_restores_state_and_hyperparameters(tmp_path):
    recipe = T.parse_command_line(TINY)[0]
    model = tiny_model()
    optimizer = T.build_optimizer(model, recipe, ns_dtype=None)
    for step in range(2):
        set_gradients(model, seed=step)
        T.apply_schedules(optimizer, 0.2 + 0.3 * step, recipe)
        optimizer.step()
    torch.save(optimizer.state_dict(), tmp_path / "optimizer.pt")
    resumed_model = copy.deepcopy(model)
    resumed = T.build_optimizer(resumed_model, recipe, ns_dtype=None)
    resumed.load_state_dict(torch.load(tmp_path / "optimizer.pt", weights_only=True))
    assert hyperparameters(resumed) == hyperparameters(optimizer) != hyperparameters(T.build_optimizer(tiny_model(), recipe))
    for p, q in zip(model.parameters(), resumed_model.parameters()):
        for key, value in optimizer.optimizer.state[p].items():
            assert torch.equal(value, resumed.optimizer.state[q][key]), key
    assert all(isinstance(g[k], float) for g in resumed.param_groups for k in T.MuonAdamW.SCHEDULED if k in g)
    for m, opt in ((model, optimizer), (resumed_model, resumed)):
        set_gradients(m, seed=5)
        T.apply_schedules(opt, 0.8, recipe)
        opt.step()
    for (name, a), b in zip(model.state_dict().items(), resumed_model.state_dict().values()):
        assert torch.equal(a, b), name

    sharded_state = dict(torch.load(tmp_path / "optimizer.pt", weights_only=True),
                         sharding={"sharded": True, "rank": 1, "world_size": 4})
    with pytest.raises(ValueError, match="resume with the same world size"):
        resumed.load_state_dict(sharded_state)


def test_bucket_layouts_cover_every_parameter_once_and_shard_evenly():
    with torch.device("meta"):
        model = T.GPT(T.model_config(T.Recipe()))  # the default d10: 60 block matrices
    order = T.gradient_ready_order(model)
    whole = set(model.blocks.parameters())
    total = model.num_params()
    for parts in (1, 2, 4, 8, 64):
        buckets = T.plan_buckets(order, whole, parts, 25 * 2**20 // 4)
        assert [id(p) for b in buckets for p in b.params] == [id(p) for p in order]  # ready order kept
        for b in buckets:
            used = [[] for _ in range(parts)]
            for p, slot in b.slots.items():
                if p in whole:  # a matrix stays whole, in one chunk
                    assert slot.owner is not None and slot.size == p.numel()
                    used[slot.owner].append((slot.offset, slot.offset + p.numel()))
                else:  # everything else is sliced over all chunks
                    assert slot.owner is None and slot.size * parts >= p.numel() > (slot.size - 1) * parts
                    for r in range(parts):
                        used[r].append((slot.offset, slot.offset + slot.size))
            for spans in used:
                spans.sort()
                assert all(a[1] <= b_[0] for a, b_ in zip(spans, spans[1:]))  # no overlap
                assert not spans or (spans[0][0] >= 0 and spans[-1][1] <= b.chunk)
        padding = sum(b.padding for b in buckets)
        if parts == 1:
            assert padding == 0 and len(buckets) >= 3  # ~240 MB of fp32 gradients in ~25 MB buckets
        if parts <= 8:
            assert padding <= T.SHARD_MAX_PADDING * total, (parts, padding / total)
        if parts == 64:  # 60 matrices for 64 ranks: one bucket, too unevenly filled for auto to shard
            assert len(buckets) == 1 and padding > T.SHARD_MAX_PADDING * total


def test_the_ready_order_is_the_order_the_backward_completes_gradients():
    """gradient_ready_order (from a forward on the meta device) against the order in which a real
    backward's post-accumulate hooks fire, on a model where every parameter gets a gradient."""
    model = tiny_model()
    with torch.no_grad():  # what init_weights starts at zero, drawn
        for p in model.parameters():
            if not p.any():
                p.normal_(0, 0.02)
    seen = []
    hooks = [p.register_post_accumulate_grad_hook(lambda p: seen.append(p)) for p in model.parameters()]
    idx = torch.randint(0, 8000, (2, 16))
    model(idx, idx).backward()
    for hook in hooks:
        hook.remove()
    names = {id(p): name for name, p in model.named_parameters()}
    assert len(seen) == len(names)
    assert [names[id(p)] for p in T.gradient_ready_order(model)] == [names[id(p)] for p in seen]


def test_the_parameter_table_and_the_schedule_refuse_what_they_do_not_know():
    model = tiny_model()
    model.extra = torch.nn.Parameter(torch.zeros(3))  # a new parameter without a row in the table
    with pytest.raises(ValueError, match=r"parameters \['extra'\] have no row in parameter_table"):
        T.build_optimizer(model, T.Recipe())
    model = tiny_model()
    optimizer = T.build_optimizer(model, T.Recipe())
    set_gradients(model, seed=0)
    adamw = next(g for g in optimizer.param_groups if g["kind"] == "adamw")
    adamw["momentum"] = 0.9  # Muon's, not AdamW's: a value its update would never read
    with pytest.raises(KeyError, match=r"got \['momentum'\], which its update does not read; it schedules "
                                       r"\['lr', 'weight_decay'\]"):
        optimizer.step()


def test_a_vector_in_a_muon_row_is_the_tables_error_naming_it(monkeypatch):
    model = tiny_model()
    model.blocks[0].norm_scale = torch.nn.Parameter(torch.ones(model.config.n_embd))  # e.g. a learned norm weight
    kit_table = T.parameter_table

    def with_the_vector_in_a_muon_row(model, recipe, ns_dtype):
        return [(params + [model.blocks[0].norm_scale] if rule["kind"] == "muon" else params, rule)
                for params, rule in kit_table(model, recipe, ns_dtype)]

    monkeypatch.setattr(T, "parameter_table", with_the_vector_in_a_muon_row)
    with pytest.raises(ValueError, match=r"parameters \['blocks.0.norm_scale \[\d+\]'\] fall in a Muon row .* "
                                         r"give them a row of their own"):
        T.build_optimizer(model, T.Recipe())


def test_two_kernel_flags_on_one_op_are_an_error(monkeypatch):
    monkeypatch.setitem(T.KERNEL_OPS, "nki_rmsnorm_v2", "norm")  # a second kernel for RMSNorm, bound by a new flag
    options = T.RunOptions(nki_rmsnorm=True)
    options.nki_rmsnorm_v2 = True
    config = T.model_config(T.parse_command_line(TINY)[0])
    with pytest.raises(SystemExit, match=r"--nki-rmsnorm and --nki-rmsnorm-v2 both replace norm\(\)|"
                                         r"--nki-rmsnorm-v2 and --nki-rmsnorm both replace norm\(\)"):
        T.setup_kernels(options, "neuron", config)


def test_writing_a_groups_learning_rate_as_nanochat_does_takes_effect():
    """`group["lr"] = ...` (nanochat's way to schedule) reaches the update at the next step, in every group."""
    model = tiny_model()
    optimizer = T.build_optimizer(model, T.Recipe(), ns_dtype=None)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    for group in optimizer.param_groups:
        group["lr"] = 0.0  # no step at all (weight decay scales with the lr too)
    set_gradients(model, seed=1)
    optimizer.step()
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
    for group in optimizer.param_groups:
        group["lr"] = group["initial_lr"]
    set_gradients(model, seed=2)
    optimizer.step()
    for name, p in model.named_parameters():
        assert not torch.equal(p, before[name]), name  # every group's parameters moved


def test_the_update_is_compiled_with_compile_and_sharded_only_across_ranks():
    model = tiny_model()
    auto = T.build_optimizer(model, T.Recipe())
    assert not auto.shard  # one process
    assert auto.optimizer._update is T.update_groups  # compiled only with --compile
    assert T.build_optimizer(model, T.Recipe(), T.RunOptions(compile=True)).optimizer._update \
        is not T.update_groups


@pytest.mark.slow
def test_sharded_step_equals_unsharded_and_resumes_from_each_ranks_state(two_rank_steps):
    """At 2 ranks (more ranks deal the matrices out otherwise: test_bucket_layouts_... covers up to 64)."""
    ranks = 2
    runs = [torch.load(two_rank_steps / f"rank{r}.pt") for r in range(ranks)]
    off, on = runs[0]["off"], runs[0]["on"]
    assert not off["sharded"] and on["sharded"] and on["buckets"] >= 2
    for run in runs:
        for mode in ("off", "on"):
            r = run[mode]
            assert r["sent_in_backward"] == [True] * 3  # every bucket left from the backward's hooks
            assert r["comm_seconds"] > 0
            assert r["loaded_hyperparameters"] == r["saved_hyperparameters"]
            for name, w in r["weights"].items():
                assert torch.equal(w, runs[0][mode]["weights"][name]), (mode, name)  # every rank agrees
                assert torch.equal(w, r["resumed_weights"][name]), (mode, name)  # the round trip is exact
    # Sharded equals unsharded within fp32 rounding of the gradient sums (whose order differs). An
    # element whose averaged gradient is at the rounding level moves by +-lr in AdamW, in either
    # direction: compare the others, relative to how far the three steps moved the tensor. Rounding can
    # still tip a single decision (AdamW's sign on a tiny gradient, Muon's cautious weight-decay mask
    # where update x weight ~ 0), moving one element by one step: allow a handful of those, not a
    # pattern (a wrong shard or a lost update moves whole slices).
    for name, a in off["weights"].items():
        real = torch.ones_like(a, dtype=torch.bool)
        for grads in off["grads"]:
            g = grads[name]
            real &= (g == 0) | (g.abs() > 1e-4 * g.abs().max())
        assert real.float().mean() > 0.5, name  # most of it is compared
        moved = (a - off["initial"][name]).abs().max()
        off_by = (a - on["weights"][name])[real].abs()
        tipped = int((off_by > 1e-3 * moved).sum())
        assert moved > 1e-4 and tipped <= max(2, off_by.numel() // 1000), (name, tipped)
        assert off_by.max() <= moved, name
    # State per rank: about 1/ranks of the replicated state (matrices are whole, so not exactly).
    replicated = off["state_bytes"]
    shares = [run["on"]["state_bytes"] for run in runs]
    assert max(shares) <= 1.25 * replicated / ranks and sum(shares) <= 1.05 * replicated
