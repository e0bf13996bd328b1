"""Shared by the rollout tests (test_ticket_book.py, test_rollout_manager.py): a TicketBook with test defaults,
and the lines of its log."""
import json

from realhf.system.rollout.ticket_book import TicketBook


def book_of(B=4, dp=1, total=6, n=10, ofp=100, conc=1000, seed=1, shuffle=True, log=None):
    return TicketBook(B, dp, total, n, ofp, conc, seed, shuffle, log_path=log)


def read_log(path):
    with open(path) as f:
        return [json.loads(line) for line in f]
