"""The co-partitioned assignor's plan (pure logic); on the real broker in
``tests/integration/test_copartitioned_group.py``."""

from services.common.assignor import copartitioned_assignment


def test_partition_p_of_every_topic_goes_to_one_member():
    members = {"m-b": ["req", "set"], "m-a": ["set", "req"], "m-c": ["req", "set"]}
    plan = copartitioned_assignment(members, {"req": range(8), "set": range(8)})
    assert plan == {"m-a": {"req": [0, 1, 2], "set": [0, 1, 2]}, "m-b": {"req": [3, 4, 5], "set": [3, 4, 5]},
                    "m-c": {"req": [6, 7], "set": [6, 7]}}


def test_more_members_than_partitions_leaves_some_idle():
    plan = copartitioned_assignment({"a": ["t"], "b": ["t"], "c": ["t"]}, {"t": [0, 1]})
    assert plan == {"a": {"t": [0]}, "b": {"t": [1]}, "c": {}}
