"""tests/cluster: spark_dl across hosts made of network namespaces (netns.py).

Root only: elsewhere every test here is skipped with the reason. Each module makes its
hosts once (a module-scoped fixture) and must leave nothing behind: after every module,
no namespace, veth or bridge of ours may remain (checked here), and no process of the
module may run on after it (each module checks its own daemons).
"""

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import netns  # noqa: E402

_REASON = []


def _reason():
    if not _REASON:
        _REASON.append(netns.unavailable())
    return _REASON[0]


def pytest_collection_modifyitems(config, items):
    mine = [item for item in items if str(item.fspath).startswith(HERE + os.sep)]
    if not mine:
        return
    reason = _reason()
    if reason is None:
        netns.sweep()  # what a killed earlier run left
        return
    skip = pytest.mark.skip(reason=f"tests/cluster: {reason}")
    for item in mine:
        item.add_marker(skip)


@pytest.fixture(autouse=True, scope="module")
def _nothing_left_behind():
    yield
    if _reason() is None:
        left = netns.leftovers()
        netns.sweep()
        assert not left, f"the module left namespaces or links behind: {left}"
