import pytest

from harness.upstream import megatron


def pytest_collection_modifyitems(config, items):
    if not megatron.available():
        skip = pytest.mark.skip(reason="megatron-core is not installed (pip install -e '.[upstream]')")
        for item in items:
            if "upstream" in item.keywords:
                item.add_marker(skip)
