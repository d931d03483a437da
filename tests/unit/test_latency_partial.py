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


def _written(path, *samples):
    """A partial profile of IDENTITY holding ``samples`` ({key: value}), as the profiler left it."""
    p = PartialProfile(path, IDENTITY, say=print)
    for k, v in samples:
        p.put(k, v)
    p.close()
    with open(path, "rb") as fh:
        return fh.read().split(b"\n")


def _rewrite(path, lines):
    with open(path, "wb") as fh:
        fh.write(b"\n".join(lines))


@pytest.mark.reliability(area="start-up profile", case="a partial latency profile whose header "
                         "is damaged: garbage, not UTF-8, blank, or JSON naming no identity, "
                         "with sound sample lines after it",
                         expect="moved aside to <file>.damaged-<n> with one line naming it and "
                         "why; none of its samples resumed; profiled from the start")
@pytest.mark.parametrize("header, why", [
    (b"garbage", "its first line is not a JSON header"),
    (b'{"identity": {"device": "cpu: t\xff\xfe"}}', "its first line is not UTF-8 text"),
    (b"", "it has no header line"),
    (b'{"identity": "cpu"}', "its first line names no profile identity"),
    (b'["first/0/0", [0.1, 0.2]]', "its first line names no profile identity"),
])
def test_a_damaged_header_is_moved_aside_and_never_resumed(tmp_path, header, why):
    path = str(tmp_path / "t.partial.jsonl")
    lines = _written(path, ("total", 4), ("first/0/0", [0.1, 0.2]), ("first/0/1", [0.3, 0.4]))
    _rewrite(path, [header] + lines[1:])
    found = open(path, "rb").read()
    said = []
    p = PartialProfile(path, IDENTITY, say=said.append)
    assert p.resumed == 0 and p.records == {} and "first/0/0" not in p
    p.close()
    aside = path + ".damaged-1"
    assert said == [f"moved the damaged partial latency profile {path} aside to {aside} "
                    f"({why}: it cannot say what its samples measured); profiling from the "
                    f"start"]
    assert open(aside, "rb").read() == found                 # kept as found, for a look
    assert read_progress(path) == (0, None)                  # a fresh profile of IDENTITY
    # a second damaged file does not overwrite the first one moved aside
    _rewrite(path, [b"garbage again", b""])
    PartialProfile(path, IDENTITY, say=said.append).close()
    assert said[-1].startswith(f"moved the damaged partial latency profile {path} aside to "
                               f"{path}.damaged-2 ")
    assert open(aside, "rb").read() == found


@pytest.mark.reliability(area="start-up profile", case="a partial latency profile with a sound "
                         "header and damaged sample lines: one not UTF-8, one not JSON, a "
                         "sample of the wrong type, negative and infinite times",
                         expect="the sound samples resumed; each damaged line dropped (measured "
                         "again), one line naming the first and the count; the file as found "
                         "moved aside")
def test_damaged_sample_lines_are_dropped_and_the_rest_resumed(tmp_path):
    path = str(tmp_path / "t.partial.jsonl")
    lines = _written(path, ("total", 12), ("first/0/0", [0.1, 0.2]))
    bad = [b'{"key": "first/0/1", "value": [0.3, 0.4]}\xff',            # not UTF-8
           b'{"key": "first/0/2", "value": [0.3, ',                      # not JSON (not last)
           b'{"key": "first/0/3", "value": "fast"}',                      # wrong type
           b'{"key": "first/0/4", "value": [-0.1, 0.2]}',                 # negative
           b'{"key": "first/0/5", "value": [1e999, 0.2]}',                # infinite
           b'{"key": "first/0/6", "value": [true, 0.2]}',                 # not a number
           b'{"key": "total", "value": "12"}',                            # wrong type
           b'{"key": "nonsense", "value": 1}',                            # unknown record
           b'{"value": [0.1, 0.2]}']                                      # no key
    good = b'{"key": "last/0/0", "value": [0.5, 0.6]}'
    _rewrite(path, lines[:-1] + bad + [good, b""])
    said = []
    p = PartialProfile(path, IDENTITY, say=said.append)
    assert p.resumed == 2 and set(p.records) == {"total", "first/0/0", "last/0/0"}
    assert p.get("total") == 12
    p.close()
    assert len(said) == 1, said
    assert said[0].startswith(f"resuming the latency profile from {path}: 2 samples were "
                              f"measured before, only the rest are measured now; 9 damaged "
                              f"line(s) dropped (line 4: not UTF-8 text and 8 more), the file "
                              f"as found moved to {path}.damaged-1"), said[0]
    assert read_progress(path) == (2, 12)
    q = PartialProfile(path, IDENTITY, say=said.append)       # the rewritten file is sound
    assert q.resumed == 2 and said[1].endswith("only the rest are measured now")
    q.close()


def test_the_cut_short_last_line_is_dropped_with_a_note(tmp_path):
    path = str(tmp_path / "t.partial.jsonl")
    lines = _written(path, ("first/0/0", [0.1, 0.2]))
    _rewrite(path, lines[:-1] + [b'{"key": "first/0/1", "value": [0.3'])   # no newline
    said = []
    PartialProfile(path, IDENTITY, say=said.append).close()
    assert said == [f"resuming the latency profile from {path}: 1 samples were measured "
                    f"before, only the rest are measured now; its last line, cut short by the "
                    f"kill, dropped"]
    assert not (tmp_path / "t.partial.jsonl.damaged-1").exists()


def test_two_profilers_cannot_write_one_profile(tmp_path):
    path = partial_path(str(tmp_path / "t.json"))
    p = PartialProfile(path, IDENTITY, say=print)
    with pytest.raises(PartialProfileBusy, match="another profiler is writing"):
        PartialProfile(path, IDENTITY, say=print)
    p.close()
    PartialProfile(path, IDENTITY, say=print).close()     # free again once the first is done
