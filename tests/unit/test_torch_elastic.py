"""spark_dl.torch.elastic on one process: the sampler's splits and the state's commit,
restore and sync (the multi-process behaviour: tests/parallel/test_elastic.py)."""

import pytest
import torch

import spark_dl.torch as hvd
from spark_dl.common import basics


def test_sampler_splits_what_is_left_among_the_ranks(monkeypatch):
    monkeypatch.setattr(basics, "is_initialized", lambda: True)
    monkeypatch.setattr(basics, "size", lambda: 3)
    monkeypatch.setattr(basics, "rank", lambda: 1)
    sampler = hvd.elastic.ElasticSampler(range(10), shuffle=False)
    assert len(sampler) == 4 and list(sampler) == [1, 4, 7, 0]  # 10 rows, 2 padded
    sampler.record_batch(0, 2)  # every rank's first batch of 2
    assert sampler.processed_indices == {0, 3, 1, 4, 2, 5}
    monkeypatch.setattr(basics, "size", lambda: 2)
    monkeypatch.setattr(basics, "rank", lambda: 0)
    sampler.reset()  # a new membership: the 4 rows left, split among 2
    assert sorted(sampler.remaining_indices) == [6, 7, 8, 9] and list(sampler) == [6, 8]
    sampler.set_epoch(1)
    assert sampler.processed_indices == set() and len(sampler) == 5


def test_batch_plan_uses_every_row_once_with_equal_steps(monkeypatch):
    monkeypatch.setattr(basics, "is_initialized", lambda: True)
    monkeypatch.setattr(basics, "size", lambda: 3)
    monkeypatch.setattr(basics, "rank", lambda: 0)
    sampler = hvd.elastic.ElasticSampler(range(10), shuffle=False, batch_size=2)
    plans = [[sampler.batch(r, b) for b in range(len(sampler))] for r in range(3)]
    assert plans == [[[0, 1], [2]], [[3, 4], [5]], [[6, 7], [8, 9]]]
    assert list(sampler) == plans[0]
    sampler.record_batch(0, 2)
    monkeypatch.setattr(basics, "size", lambda: 2)
    sampler.reset()  # 4 rows left, 2 ranks: no padding
    assert sorted(sampler.remaining_indices) == [2, 5, 8, 9]
    assert [sampler.batch(r, 0) for r in range(2)] == [[2, 5], [8, 9]]
    # Fewer rows left than ranks: the one case that pads (as without batch_size).
    sampler.record_indices([2, 5, 8])
    sampler.reset()
    assert [sampler.batch(r, 0) for r in range(2)] == [[9], [9]]
    loader = torch.utils.data.DataLoader(list(range(10)), batch_sampler=sampler)
    assert [b.tolist() for b in loader] == [[9]]
    with pytest.raises(ValueError, match="batch_size must be at least 1"):
        hvd.elastic.ElasticSampler(range(3), batch_size=0)


def test_shuffled_order_depends_on_seed_and_epoch_only():
    a = hvd.elastic.ElasticSampler(range(50), seed=4)
    b = hvd.elastic.ElasticSampler(range(50), seed=4)
    assert list(a) == list(b) and list(a) != list(range(50))
    b.set_epoch(1)
    assert list(a) != list(b)


@pytest.fixture
def single():
    hvd.init()
    yield
    hvd.shutdown()


def test_state_commit_restore_and_sync(single):
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sampler = hvd.elastic.ElasticSampler(range(8), shuffle=False)
    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, seen=[])
    before = model.weight.detach().clone()
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    state.epoch, state.seen = 3, [1]
    sampler.record_indices([0, 1])
    state.restore()  # nothing committed since the start
    assert torch.equal(model.weight, before) and state.epoch == 0 and state.seen == []
    assert sampler.processed_indices == set() and not optimizer.state
    optimizer.step()
    state.epoch = 2
    sampler.record_indices([5])
    state.commit()
    state.epoch = 7
    state.restore()
    assert state.epoch == 2 and sampler.processed_indices == {5}
    state.sync()
    assert state.epoch == 2 and len(sampler) == 7
    calls = []
    state.register_reset_callbacks([lambda: calls.append(hvd.size())])
    state.on_reset()
    assert calls == [1]


def test_commit_raises_hosts_updated_only_in_an_elastic_job(single):
    state = hvd.elastic.ObjectState(hvd.broadcast_object, hvd.rank, step=1)
    state.commit()  # not elastic: nothing to ask
    assert state.step == 1
