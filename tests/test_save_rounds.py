"""When a round of a save (tfdist.save_rounds) gives up on a worker: at once when it exited, went on past this point
or is in another round here; after SKEW_S, and only for worker 0, when it is alive outside fit; never before the
caller's bound when it is behind or frozen (it may still come). The jobs are in test_sharded_state_multi_worker.py."""

import time

from tfdist import save_rounds
from tfdist.save_rounds import ALIVE_S, SKEW_S


def state(fit=1, epoch=-1, depth=0, round=None, exited=False, beat=0):  # noqa: A002  (the published field)
    return {"fit": fit, "epoch": epoch, "depth": depth, "round": round, "exited": exited, "beat": beat}


ME = state(round="1.1073741824.1")  # after fit 1, in its first round there


def verdicts(peer_beats, rank=0, me=ME):
    """not_coming for worker 1 read at each (seconds, its state) in ``peer_beats`` by a worker in ``me``'s round, with
    one ``seen`` throughout."""
    seen = {}
    return [save_rounds.not_coming(1, peer, me, rank, me["round"], seen, now) for now, peer in peer_beats]


def test_a_worker_that_exited_went_on_or_is_in_another_round_is_not_coming_at_once():
    assert verdicts([(0, state(exited=True))]) == ["worker 1 exited without taking part"]
    assert save_rounds.not_coming(1, state(), ME, 0, ME["round"], {}, 0, gone=True) == (
        "worker 1 exited without taking part")  # its process is gone (os._exit, SIGKILL): its state never said so
    assert verdicts([(0, state(fit=2, depth=1))]) == [
        "worker 1 went on without taking part: it is in fit 2, past this point (after fit 1)"]
    in_fit = state(depth=1, round="1.0.1")  # saving in epoch 1's callbacks
    assert verdicts([(0, state(depth=1, epoch=0))], me=in_fit) == [
        "worker 1 went on without taking part: it is in fit 1, after epoch 1, past this point (in fit 1)"]
    assert verdicts([(0, state(round="1.1073741824.2"))], rank=1) == [
        "worker 1 is in a later round at this point (its 1.1073741824.2, this worker's 1.1073741824.1): the workers' "
        "saves are out of step since one was called on some workers only"]


def test_worker_0_gives_up_on_a_live_idle_worker_after_skew_seconds():
    beating = [(t, state(beat=t)) for t in range(int(SKEW_S) + 1)]
    assert verdicts(beating)[:-1] == [None] * int(SKEW_S)
    assert verdicts(beating)[-1] == (f"worker 1 is alive after fit 1 but has not taken part within {SKEW_S:g} s: it "
                                     "does something else")


def test_a_worker_behind_frozen_or_waiting_for_worker_0_is_waited_for():
    long_after = 10 * SKEW_S
    assert verdicts([(0, None), (long_after, None)]) == [None, None]  # published nothing yet
    assert verdicts([(0, state(depth=1)), (long_after, state(depth=1))]) == [None, None]  # still in fit 1
    assert verdicts([(0, state(beat=3)), (long_after, state(beat=3))]) == [None, None]  # frozen: no heartbeat
    froze = [(0, state(beat=1)), (1, state(beat=2)), (1 + ALIVE_S + 1, state(beat=2)), (long_after, state(beat=2))]
    assert verdicts(froze) == [None] * 4  # its heartbeat moved, then stopped: it may still come
    second = state(round="1.1073741824.2")  # this worker's second round here; worker 1's state still shows its first
    first = ME["round"]
    assert verdicts([(0, state(round=first)), (long_after, state(round=first))], rank=1, me=second) == [None, None]
    beating = [(t, state(beat=t)) for t in range(int(long_after))]
    assert set(verdicts(beating, rank=1)) == {None}  # a worker other than 0 waits for worker 0 doing work of its own


def test_reads_that_fail_at_once_are_paced_and_tell_a_worker_other_than_0_that_worker_0_is_gone():
    """Reads of a store that is gone (worker 0, which holds it, exited) fail at once, as in this process, which has
    none. Worker 0 (whose store cannot be gone) waits out its bound without spinning; another worker stops waiting."""
    cpu, began = time.process_time(), time.monotonic()
    assert save_rounds.agree(0, 2, 2.0) == "worker(s) [1] did not take part within 2 s"
    assert time.monotonic() - began >= 2.0 and time.process_time() - cpu < 0.5
    began = time.monotonic()
    assert save_rounds.agree(1, 2, 60.0) == "worker 0 is gone: the job's store, which it holds, refuses every read"
    assert time.monotonic() - began < 5
