"""The partial latency profile (latency/partial.py): samples saved as measured, resumed by a profile
of the same identity, ignored with a message for another, a torn last line dropped, one writer."""

import json

import pytest

from sparsebalance_megatron.latency.partial import (PartialProfile, PartialProfileBusy,
                                                    partial_path, read_progress)

IDENTITY = {"device": "cpu: test", "model": {"num_layers": 2}, "mixes": [[128], [64, 64]],
            "densities": (0.25, 1.0)}


def test_samples_survive_and_are_resumed_by_the_same_identity(tmp_path):
    path = str(tmp_path / "t.json.partial.jsonl")
    lines = []
    p = PartialProfile(path, IDENTITY, say=lines.append)
    assert lines == [] and p.resumed == 0
    p.put("total", 4)
    p.put("first/0/0", [0.1, 0.2])
    p.put("first/0/1", (0.3, 0.4))
    p.close()                        # the process dies here: nothing more is written
    assert read_progress(path) == (2, 4)
    q = PartialProfile(path, dict(IDENTITY), say=lines.append)
    assert q.resumed == 2 and "first/0/1" in q and q.get("first/0/1") == [0.3, 0.4]
    assert "first/0/2" not in q and q.get("total") == 4
    assert len(lines) == 1 and "resuming" in lines[0] and "2 samples" in lines[0]
    q.discard()
    assert read_progress(path) is None


@pytest.mark.reliability(area="start-up profile", case="a partial latency profile of another "
                         "model/flags/device left in the cache",
                         expect="ignored with a message naming the file and what differs; "
                         "profiled from the start")
def test_another_identity_is_ignored_with_a_message(tmp_path):
    path = str(tmp_path / "t.partial.jsonl")
    p = PartialProfile(path, IDENTITY, say=print)
    p.put("first/0/0", [0.1, 0.2])
    p.close()
    lines = []
    other = {**IDENTITY, "model": {"num_layers": 4}, "device": "cpu: other"}
    q = PartialProfile(path, other, say=lines.append)
    assert q.resumed == 0 and "first/0/0" not in q
    assert len(lines) == 1 and path in lines[0] and "device, model differ" in lines[0]
    q.close()
    header = json.loads(open(path).readline())
    assert header["identity"]["model"] == {"num_layers": 4}   # the file now holds the new one


def test_a_line_torn_by_a_kill_is_dropped_and_the_next_append_is_whole(tmp_path):
    path = str(tmp_path / "t.partial.jsonl")
    p = PartialProfile(path, IDENTITY, say=print)
    p.put("first/0/0", [0.1, 0.2])
    p.close()
    with open(path, "a") as fh:      # killed in the middle of writing a line
        fh.write('{"key": "first/0/1", "val')
    q = PartialProfile(path, IDENTITY, say=lambda _: None)
    assert q.resumed == 1 and "first/0/1" not in q
    q.put("first/0/1", [0.5, 0.6])
    q.close()
    r = PartialProfile(path, IDENTITY, say=lambda _: None)
    assert r.resumed == 2 and r.get("first/0/1") == [0.5, 0.6]
    r.close()


def test_an_unreadable_file_is_replaced(tmp_path):
    path = str(tmp_path / "t.partial.jsonl")
    with open(path, "w") as fh:
        fh.write("not json\n")
    lines = []
    PartialProfile(path, IDENTITY, say=lines.append).close()
    assert "unreadable" in lines[0] and read_progress(path) == (0, None)


def test_two_profilers_cannot_write_one_profile(tmp_path):
    path = partial_path(str(tmp_path / "t.json"))
    p = PartialProfile(path, IDENTITY, say=print)
    with pytest.raises(PartialProfileBusy, match="another profiler is writing"):
        PartialProfile(path, IDENTITY, say=print)
    p.close()
    PartialProfile(path, IDENTITY, say=print).close()     # free again once the first is done
