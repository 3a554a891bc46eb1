"""``in_buckets``: the one rule that cuts a whole-model gather into collectives, without a process group."""

from autopar.core.comm import in_buckets


def test_buckets_group_by_key_keep_order_and_never_exceed_the_limit():
    items = [("a", 40), ("b", 10), ("a", 40), ("a", 30), ("b", 95), ("a", 150), ("b", 5)]
    assert in_buckets(items, 100) == [("a", [0, 2]), ("a", [3]), ("a", [5]), ("b", [1]), ("b", [4, 6])]
    # an item above the limit travels alone; nothing is dropped or repeated
    assert sorted(i for _, b in in_buckets(items, 100) for i in b) == list(range(len(items)))
    assert in_buckets([], 100) == []
