"""DistributedOptimizer and broadcast_optimizer_state in one process: wrapping, argument
checks, and that with one rank it is exactly the wrapped optimizer (as in Horovod). The
multi-rank behaviour is in tests/parallel/test_torch_optimizer.py."""

import pytest
import torch

import spark_dl.torch as hvd

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module", autouse=True)
def runtime():
    hvd.init()
    yield
    hvd.shutdown()


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))


def test_wrapped_optimizer_keeps_its_class_groups_and_state():
    model = _model()
    base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(2, 3)).sum().backward()
    base.step()
    opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
    assert isinstance(opt, torch.optim.SGD) and type(opt).__name__ == "SGD"
    assert opt.param_groups is base.param_groups
    assert opt.state is base.state and len(opt.state) == 4
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)
    opt.load_state_dict(opt.state_dict())
    with pytest.raises(ValueError, match="already a DistributedOptimizer"):
        hvd.DistributedOptimizer(opt)


def test_one_rank_steps_like_the_wrapped_optimizer():
    a, b = _model(), _model()
    opt_a = hvd.DistributedOptimizer(torch.optim.Adam(a.parameters(), lr=0.01),
                                     named_parameters=a.named_parameters(),
                                     backward_passes_per_step=2)
    opt_b = torch.optim.Adam(b.parameters(), lr=0.01)
    for step in range(3):
        x = torch.randn(5, 3, generator=torch.Generator().manual_seed(step))
        for model, opt in ((a, opt_a), (b, opt_b)):
            opt.zero_grad()
            for _ in range(2):
                model(x).pow(2).mean().backward()
            opt.step()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    with opt_a.skip_synchronize():
        opt_a.synchronize()
        opt_a.step()


@pytest.mark.parametrize("kwargs,needle", [
    ({"named_parameters": [torch.ones(1)]}, "sequence of tuples"),
    ({"named_parameters": "dup"}, "must be unique. Found duplicates: w"),
    ({"named_parameters": "partial"}, "were not named"),
    ({"op": hvd.Sum, "gradient_predivide_factor": 2.0}, "gradient_predivide_factor not supported"),
    ({"op": hvd.Adasum}, "Adasum is not supported"),
    ({"backward_passes_per_step": 0}, "backward_passes_per_step must be >= 1"),
    ({"groups": -1}, "non-negative integer"),
    ({"groups": [[1.0]]}, "only torch.Tensor"),
    ({"groups": "dup_group"}, "more than one group"),
])
def test_argument_checks(kwargs, needle):
    model = _model()
    params = list(model.parameters())
    if kwargs.get("named_parameters") == "dup":
        kwargs["named_parameters"] = [("w", p) for p in params]
    elif kwargs.get("named_parameters") == "partial":
        kwargs["named_parameters"] = list(model.named_parameters())[:2]
    if kwargs.get("groups") == "dup_group":
        kwargs["groups"] = [[params[0]], [params[0], params[1]]]
    with pytest.raises(ValueError, match=needle):
        hvd.DistributedOptimizer(torch.optim.SGD(params, lr=0.1), **kwargs)
    with pytest.raises(ValueError, match="torch.optim.Optimizer"):
        hvd.DistributedOptimizer(object())


def test_groups_are_formed_from_parameter_order():
    from spark_dl.torch.optimizer import _form_groups

    params = [torch.zeros(1, requires_grad=True) for _ in range(5)]
    sizes = [len(g) for g in _form_groups(3, params)]
    assert sizes == [2, 2, 1]
    assert [len(g) for g in _form_groups(9, params)] == [1] * 5
    assert _form_groups(0, params) == [] and _form_groups(None, params) == []
    with pytest.warns(DeprecationWarning):
        hvd.DistributedOptimizer(torch.optim.SGD(params, lr=0.1), num_groups=2)


def test_broadcast_optimizer_state_on_one_rank_keeps_state():
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.ones(2, 3)).sum().backward()
    opt.step()
    before = {k: v.clone() for k, v in opt.state[next(model.parameters())].items()}
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    after = opt.state[next(model.parameters())]
    assert all(torch.equal(before[k], after[k]) for k in before)
    lbfgs = torch.optim.LBFGS(model.parameters())
    hvd.broadcast_optimizer_state(lbfgs, root_rank=0)  # any optimizer, even with empty state


def test_state_structure_round_trips():
    from spark_dl.torch.functions import _collect_slots, _join_tensors, _split_tensors

    state = {"state": {0: {"step": torch.tensor(3.0), "buf": [torch.ones(2), 5]}},
             "param_groups": [{"lr": 0.1, "params": [0]}]}
    tensors = []
    skeleton = _split_tensors(state, tensors)
    assert len(tensors) == 2
    slots = []
    _collect_slots(skeleton, slots)
    assert [s.index for s in slots] == [0, 1] and slots[1].shape == (2,)
    rebuilt = _join_tensors(skeleton, tensors)
    assert rebuilt["state"][0]["buf"][1] == 5 and rebuilt["state"][0]["step"] is tensors[0]


def test_step_hooks_fire_once_per_step_also_after_load_state_dict():
    """load_state_dict (a resume, broadcast_optimizer_state on every other rank) lets torch
    wrap the step of the optimizer's class for its hooks: the DistributedOptimizer's step
    must not be wrapped again, or each hook fires twice, the outer pre-hook before the
    gradients are synchronized."""
    model = torch.nn.Linear(4, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters())
    calls = []
    opt.register_step_pre_hook(lambda o, a, k: calls.append("pre"))
    opt.register_step_post_hook(lambda o, a, k: calls.append("post"))

    def step():
        opt.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        opt.step()

    step()
    assert calls == ["pre", "post"]
    opt.load_state_dict(opt.state_dict())
    calls.clear()
    step()
    assert calls == ["pre", "post"]
