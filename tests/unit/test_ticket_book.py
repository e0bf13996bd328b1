"""The ticket book of asynchronous RL's rollout manager (realhf.system.rollout.ticket_book.TicketBook).

Prompts in the synchronous order (EpochIterator's, heads per rank_share), staleness and concurrency refusals,
rejected/failed episodes re-issued, restore from the log after a crash, and a randomized property test that
checks the log: the staleness bound at every issue, every slot accepted exactly once, no prompt lost.
"""
import random

import pytest

from realhf.impl.dataset.jsonl import EpochIterator
from realhf.system.rollout.ticket_book import TicketBook

from support.ticket_book_util import book_of, read_log


def take_all(book):
    out = []
    while True:
        t, reason = book.allocate("w")
        if t is None:
            return out, reason
        out.append(t)


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("dp", [1, 2])
@pytest.mark.parametrize("n", [10, 12])
def test_order_is_the_synchronous_one(shuffle, dp, n):
    B, total = 4, 7  # 2 or 3 steps an epoch: several epochs
    book = book_of(B=B, dp=dp, total=total, n=n, shuffle=shuffle)
    tickets, reason = take_all(book)
    assert reason == "done" and len(tickets) == total * B
    assert [(t.batch, t.slot, t.cursor) for t in tickets] == [(b, j, b * B + j) for b in range(total) for j in range(B)]
    # what each data-parallel rank of a synchronous run trains, step by step
    refs = [EpochIterator(range(n), B, seed=1, dp_rank=r, dp_size=dp, shuffle=shuffle,
                          drop_last=True if n % B else None) for r in range(dp)]
    for b in range(total):
        for r in range(dp):
            mine = [t.prompt for t in tickets if t.batch == b and t.head == r]
            assert mine == refs[r].next_indices(), (b, r)


@pytest.mark.parametrize("ofp", [0, 2])
def test_staleness_refusals(ofp):
    B = 2
    book = book_of(B=B, total=10, ofp=ofp)
    tickets, reason = take_all(book)
    assert reason == "staleness" and len(tickets) == (ofp + 1) * B
    assert max(t.batch for t in tickets) == ofp
    for t in tickets:
        book.finish(t.id, "accepted")
    assert book.allocate("w") == (None, "staleness")  # accepted trajectories do not move the bound, versions do
    book.set_version(1)
    more, reason = take_all(book)
    assert reason == "staleness" and [t.batch for t in more] == [ofp + 1] * B
    assert all(t.version == 1 for t in more)
    assert book.stats()["refused_staleness"] == 3


def test_concurrency_refusals():
    book = book_of(conc=3)
    ts, reason = take_all(book)
    assert len(ts) == 3 and reason == "concurrency" and book.stats()["refused_concurrency"] == 1
    book.finish(ts[1].id, "accepted")
    t, reason = book.allocate("w")
    assert reason == "ok" and (t.batch, t.slot) == (0, 3)


def test_rejected_reissues_the_slot_with_the_next_prompt():
    book = book_of(B=2)
    a, b, c = (book.allocate("w")[0] for _ in range(3))
    assert [(t.batch, t.slot, t.cursor) for t in (a, b, c)] == [(0, 0, 0), (0, 1, 1), (1, 0, 2)]
    book.finish(a.id, "rejected")
    t = book.allocate("w")[0]
    assert (t.batch, t.slot, t.cursor, t.prompt) == (0, 0, 3, book.prompt_at(3)) and t.id not in (a.id, b.id, c.id)
    t2 = book.allocate("w")[0]
    assert (t2.batch, t2.slot, t2.cursor) == (1, 1, 4)
    assert book.stats()["rejected"] == 1


def test_failed_reissues_the_slot_with_the_same_prompt():
    book = book_of(B=2)
    a, b, c = (book.allocate("w")[0] for _ in range(3))
    book.finish(b.id, "failed")
    assert book.stats()["queued"] == 1
    t = book.allocate("w")[0]
    assert (t.batch, t.slot, t.cursor, t.prompt) == (0, 1, 1, b.prompt) and t.id != b.id
    assert (book.allocate("w")[0].cursor) == 3


def test_a_lost_worker_s_tickets_come_back_with_their_prompts():
    book = book_of(B=4)
    a, b = book.allocate("w0")[0], book.allocate("w1")[0]
    c = book.allocate("w1")[0]
    book.finish(b.id, "accepted")
    assert [t.id for t in book.release("w1", "exited with code -9")] == [c.id]  # the accepted one stays accepted
    assert book.release("w1", "again") == [] and book.stats()["running"] == 1 and book.stats()["failed"] == 1
    t = book.allocate("w0")[0]
    assert (t.batch, t.slot, t.prompt) == (c.batch, c.slot, c.prompt)
    with pytest.raises(ValueError, match="not running"):
        book.finish(c.id, "accepted")  # a late report of the lost worker does not fill the slot twice
    book.finish(a.id, "accepted")


def test_done_complete_and_errors():
    book = book_of(B=2, total=1)
    a, b = book.allocate("w")[0], book.allocate("w")[0]
    assert book.allocate("w") == (None, "done") and not book.complete
    book.finish(a.id, "failed")
    assert book.allocate("w")[0].prompt == a.prompt
    with pytest.raises(ValueError, match="ticket 99"):
        book.finish(99, "accepted")
    book.finish(b.id, "accepted")
    with pytest.raises(ValueError, match=f"ticket {b.id}"):
        book.finish(b.id, "accepted")
    with pytest.raises(ValueError, match="status"):
        book.finish(a.id + 2, "maybe")
    with pytest.raises(ValueError, match="reserved"):
        book.finish(a.id + 2, "accepted", {"status": 1})
    book.set_version(3)
    with pytest.raises(ValueError, match="lower"):
        book.set_version(2)
    book.finish(a.id + 2, "accepted", {"reward": 1.0})
    assert book.complete and book.allocate("w") == (None, "done")


def test_log_lines(tmp_path):
    log = str(tmp_path / "r.jsonl")
    book = book_of(B=2, dp=2, log=log)
    t = book.allocate("worker-3")[0]
    book.finish(t.id, "accepted", {"reward": 0.5, "n_tokens": 7})
    book.set_version(1)
    book.close()
    issue, fin, ver = read_log(log)
    assert issue == {"event": "issue", "ticket": 0, "batch": 0, "slot": 0, "head": 0, "prompt": t.prompt, "cursor": 0,
                     "version": 0, "worker": "worker-3", "t": issue["t"]}
    assert fin["event"] == "finish" and fin["ticket"] == 0 and fin["status"] == "accepted" and fin["reward"] == 0.5
    assert ver["event"] == "version" and ver["version"] == 1 and "t" in ver
    book2 = book_of(B=2, dp=2, log=log)
    book2.restore(0)
    book2.close()
    assert read_log(log)[-1]["event"] == "restore" and read_log(log)[-1]["trained_batches"] == 0


def test_restore_without_a_log():
    book = book_of(B=3, ofp=0)
    book.restore(2)
    t = book.allocate("w")[0]
    assert (t.batch, t.slot, t.cursor, t.version) == (2, 0, 6, 2) and book.version == 2


def test_restore_keeps_the_staleness_bound_and_drops_a_torn_line(tmp_path):
    """Before the crash the servers were at version 4 and batches up to 5 (ofp 1) were out; the trainer resumes
    from step 2. The re-queued slots of batches 4 and 5 must wait for versions 3 and 4 again."""
    log = str(tmp_path / "r.jsonl")
    B, ofp = 2, 1
    book = book_of(B=B, total=8, ofp=ofp, log=log)
    for v in range(5):
        if v:
            book.set_version(v)
        for t in take_all(book)[0]:
            if t.batch != 5:  # batch 5 is still running at the crash
                book.finish(t.id, "accepted")
    book.close()
    with open(log, "a") as f:
        f.write('{"event": "finish", "tick')  # the crash cut the last line
    book = book_of(B=B, total=8, ofp=ofp, log=log)
    book.restore(2)
    ts, reason = take_all(book)
    assert reason == "staleness" and [(t.batch, t.slot) for t in ts] == [(2, 0), (2, 1), (3, 0), (3, 1)]
    assert [t.cursor for t in ts] == [4, 5, 6, 7] and all(t.version == 2 for t in ts)
    book.set_version(3)
    ts, reason = take_all(book)
    assert reason == "staleness" and [(t.batch, t.cursor) for t in ts] == [(4, 8), (4, 9)]
    book.set_version(4)
    ts = take_all(book)[0]
    assert [(t.batch, t.cursor) for t in ts][:2] == [(5, 10), (5, 11)]
    book.close()
    lines = read_log(log)  # every line parses: the torn one is gone
    assert lines[-1]["event"] == "issue" and any(r["event"] == "restore" for r in lines)


def _check_log(log, B, total, ofp, n, seed, shuffle, no_rejections):
    """The properties of a whole run, from its log alone."""
    it = EpochIterator(range(n), B, seed=seed, shuffle=shuffle, drop_last=True)
    per_epoch = it.steps_per_epoch * B
    version, issued = 0, {}
    final = {}  # (batch, slot) -> cursor of the accepted (and not undone by a restore) trajectory
    rejected = set()
    for rec in read_log(log):
        ev = rec["event"]
        if ev == "issue":
            assert rec["batch"] <= version + ofp and rec["version"] == version, rec
            e, k = divmod(rec["cursor"], per_epoch)
            assert rec["prompt"] == it.global_batch_indices(e, k // B)[k % B], rec
            issued[rec["ticket"]] = rec
        elif ev == "finish":
            i = issued[rec["ticket"]]
            key = (i["batch"], i["slot"])
            if rec["status"] == "accepted":
                assert key not in final, f"slot {key} accepted twice"
                final[key] = i["cursor"]
            elif rec["status"] == "rejected":
                rejected.add(i["cursor"])
        elif ev == "version":
            assert rec["version"] > version
            version = rec["version"]
        elif ev == "restore":
            version = rec["trained_batches"]
            final = {k: c for k, c in final.items() if k[0] < version}
    assert set(final) == {(b, j) for b in range(total) for j in range(B)}
    used = max(r["cursor"] for r in issued.values())
    acc = list(final.values())
    assert len(set(acc)) == len(acc), "a prompt was trained twice"
    assert not set(acc) & rejected
    assert set(acc) | rejected == set(range(used + 1)), "a prompt of the stream was lost"
    if no_rejections:
        assert all(c == b * B + j for (b, j), c in final.items())


@pytest.mark.parametrize("case", range(40))
def test_random_interleavings_keep_the_invariants(case, tmp_path):
    rng = random.Random(case)
    B = rng.randint(1, 4)
    dp, total, ofp = rng.randint(1, B), rng.randint(2, 7), rng.randint(0, 2)
    n, conc, shuffle, seed = rng.randint(B, 3 * B + 1), rng.randint(1, 6), rng.random() < 0.5, rng.randint(0, 9)
    p_rej = 0.0 if case % 2 else 0.2
    log = str(tmp_path / "r.jsonl")
    make = lambda: TicketBook(B, dp, total, n, ofp, conc, seed, shuffle, log_path=log)  # noqa: E731
    book, running, acc, trained, crashes = make(), [], set(), 0, rng.randint(0, 3)
    for _ in range(20000):
        if book.complete:
            break
        op = rng.random()
        if op < 0.35:
            t, reason = book.allocate("w")
            if t is not None:
                assert t.batch <= book.version + ofp and t.head == book.head_of(t.slot)
                running.append(t)
        elif op < 0.75 and running:
            t = running.pop(rng.randrange(len(running)))
            status = rng.choices(["accepted", "rejected", "failed"], [1 - p_rej - 0.15, p_rej, 0.15])[0]
            book.finish(t.id, status, {"worker_stat": rng.random()})
            if status == "accepted":
                acc.add((t.batch, t.slot))
        elif op < 0.97:
            while trained < total and all((trained, j) in acc for j in range(B)):
                trained += 1
            if book.version < trained:
                book.set_version(rng.randint(book.version + 1, trained))
        elif crashes:
            crashes -= 1
            G = rng.randint(0, trained)
            book.close()
            book = make()
            book.restore(G)
            running, trained = [], G
            acc = {k for k in acc if k[0] < G}
    assert book.complete, (book.stats(), trained, sorted(acc))
    book.close()
    _check_log(log, B, total, ofp, n, seed, shuffle, no_rejections=p_rej == 0)
