"""Drain order: oldest settled first, writers and the settle window respected, markers last."""

import posixpath

from hypothesis import given, settings
from hypothesis import strategies as st

from ckptfs.drain.schedule import Candidate, eligible, held_by_lost, is_marker, marker_waits_for, order_tombstones

MARKERS = [".metadata", "latest*", "commit_success.txt", "*COMPLETE*"]
S = 1_000_000_000


def cand(ino, path, since=0, changed=0, writers=0, urgent=False, is_dir=False, lost=False, also=()):
    return Candidate(ino, path, since * S, changed * S, is_dir, writers, urgent, lost, tuple(also))


def paths(cands):
    return [c.path for c in cands]


def test_oldest_first():
    cs = [cand(1, "b", since=5), cand(2, "a", since=1), cand(3, "c", since=3)]
    assert paths(eligible(cs, now_ns=100 * S, settle_ns=S, markers=MARKERS, busy=set())) == ["a", "c", "b"]


def test_open_writer_and_settle_window_hold_a_file_back():
    cs = [cand(1, "open", writers=1), cand(2, "fresh", changed=99.5), cand(3, "settled", changed=90)]
    assert paths(eligible(cs, now_ns=100 * S, settle_ns=S, markers=MARKERS, busy=set())) == ["settled"]


def test_urgent_ignores_writer_and_settle():
    cs = [cand(1, "fsynced", writers=1, changed=100, urgent=True)]
    assert paths(eligible(cs, now_ns=100 * S, settle_ns=S, markers=MARKERS, busy=set())) == ["fsynced"]


def test_busy_inode_not_started_twice():
    cs = [cand(1, "a")]
    assert eligible(cs, now_ns=100 * S, settle_ns=S, markers=MARKERS, busy={1}) == []


def test_marker_waits_for_shards_in_its_directory_and_below():
    cs = [cand(1, "step_1/.metadata", since=0), cand(2, "step_1/__0_0.distcp", since=1),
          cand(3, "step_1/sub/shard", since=2), cand(4, "step_2/x", since=3)]
    got = paths(eligible(cs, now_ns=100 * S, settle_ns=S, markers=MARKERS, busy=set()))
    assert "step_1/.metadata" not in got
    assert got == ["step_1/__0_0.distcp", "step_1/sub/shard", "step_2/x"]


def test_marker_goes_once_shards_are_durable():
    cs = [cand(1, "step_1/.metadata"), cand(4, "step_2/x")]
    assert "step_1/.metadata" in paths(eligible(cs, now_ns=100 * S, settle_ns=S, markers=MARKERS, busy=set()))


def test_markers_in_same_directory_do_not_deadlock():
    cs = [cand(1, "step_1/.metadata"), cand(2, "step_1/commit_success.txt")]
    assert len(eligible(cs, now_ns=100 * S, settle_ns=S, markers=MARKERS, busy=set())) == 2


def test_latest_pointer_waits_for_deeper_markers():
    cs = [cand(1, "run/latest"), cand(2, "run/step_9/.metadata")]
    assert paths(eligible(cs, now_ns=100 * S, settle_ns=S, markers=MARKERS, busy=set())) == ["run/step_9/.metadata"]


def test_a_shard_hard_linked_into_a_checkpoint_holds_back_its_marker_by_any_name():
    cs = [cand(1, "ck1/.metadata"), cand(2, "ck0/sub/s2", also=["ck1/sub/s2"])]
    assert paths(eligible(cs, now_ns=100 * S, settle_ns=S, markers=MARKERS, busy=set())) == ["ck0/sub/s2"]


def test_a_marker_known_first_by_another_name_still_waits_for_its_checkpoint():
    cs = [cand(1, "a/x", also=["ck1/.metadata"]), cand(2, "ck1/s0")]
    assert paths(eligible(cs, now_ns=100 * S, settle_ns=S, markers=MARKERS, busy=set())) == ["ck1/s0"]


def test_markers_that_wait_for_each_other_through_hard_links_both_go():
    # ck0/.metadata is also ck1/x and ck1/.metadata is also ck0/y: neither can go after the other.
    cs = [cand(1, "ck0/.metadata", also=["ck1/x"]), cand(2, "ck1/.metadata", also=["ck0/y"]), cand(3, "ck0/s0")]
    got = paths(eligible(cs, now_ns=100 * S, settle_ns=S, markers=MARKERS, busy=set()))
    assert got == ["ck1/.metadata", "ck0/s0"]  # ck0's marker still waits for its plain shard
    cs = cs[:2]
    assert paths(eligible(cs, now_ns=100 * S, settle_ns=S, markers=MARKERS, busy=set())) == [
        "ck0/.metadata", "ck1/.metadata"]


def test_a_lost_shard_holds_back_a_marker_through_its_second_name():
    marker = cand(1, "ck1/.metadata")
    assert held_by_lost(marker, [marker, cand(2, "ck0/s2", lost=True, also=["ck1/s2"])], MARKERS)
    assert not held_by_lost(marker, [marker, cand(2, "ck0/s2", lost=True)], MARKERS)


def test_marker_patterns_are_configurable():
    cs = [cand(1, "ck/DONE"), cand(2, "ck/shard")]
    got = paths(eligible(cs, now_ns=100 * S, settle_ns=S, markers=["DONE"], busy=set()))
    assert got == ["ck/shard"]


def test_deletes_put_markers_first():
    batches = order_tombstones(["s/a", "s/.metadata", "s/b", "s/"], MARKERS)
    assert batches == [["s/.metadata"], ["s/", "s/a", "s/b"]]


def _reference_eligible(cands, markers):
    """The marker rule read literally (every marker name against every name of every other
    pending inode), for comparison with the indexed ``eligible``."""
    def waits_for(c):
        out = set()
        for m in (p for p in c.paths if not c.is_dir and is_marker(p, markers)):
            d = posixpath.dirname(m)
            for o in cands:
                if o.ino == c.ino:
                    continue
                if o.is_dir:
                    if o.path and (o.path == d or d == "" or o.path.startswith(d + "/") or d.startswith(o.path + "/")):
                        out.add(o.ino)
                elif any(marker_waits_for(m, p, markers) for p in o.paths):
                    out.add(o.ino)
        return out

    waits = {c.ino: waits_for(c) for c in cands}

    def reaches(start, target, seen=()):
        return any(n == target or (n not in seen and reaches(n, target, (*seen, n))) for n in waits[start])

    return [c.ino for c in sorted(cands, key=lambda c: (c.since_ns, c.ino))
            if not any(not reaches(o, c.ino) for o in waits[c.ino])]


NAMES = st.sampled_from(["a", "b", ".metadata", "latest", "c"])
PATH = st.lists(NAMES, min_size=1, max_size=3).map("/".join)


@st.composite
def queues(draw):
    out = []
    for ino in range(1, draw(st.integers(1, 8)) + 1):
        if draw(st.booleans()) and draw(st.booleans()):
            out.append(cand(ino, draw(PATH | st.just("")), since=draw(st.integers(0, 3)), is_dir=True))
        else:
            out.append(cand(ino, draw(PATH), since=draw(st.integers(0, 3)), also=draw(st.lists(PATH, max_size=2))))
    return out


@settings(max_examples=300, deadline=None)
@given(queues())
def test_the_indexed_marker_rule_agrees_with_the_rule_read_literally(cs):
    markers = [".metadata", "latest*"]
    got = [c.ino for c in eligible(cs, now_ns=100 * S, settle_ns=S, markers=markers, busy=set())]
    assert got == _reference_eligible(cs, markers)
