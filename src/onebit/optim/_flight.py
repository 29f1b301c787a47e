"""A DiLoCo synchronisation in flight (Streaming DiLoCo's delay, arXiv 2501.18512, section 2): its
exchange completed on a thread of its own while the inner steps go on, and at exit where a run
ends before it lands."""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from collections.abc import Sequence

from torch import Tensor

from .. import comm

__all__ = ["Flight"]

_log = logging.getLogger("onebit.optim")


class Flight:
    """A synchronisation in flight: the step it lands at, its averaged outer gradients (one flat
    fp32 tensor per run of its fragment, ``landing[b]``) and, while its exchange runs, the thread
    completing it. The first collective of each run left on the caller's thread; the rest runs
    on this one, so that each phase leaves as soon as the one before is done whatever this rank
    is computing, and nothing on this rank -- nor a peer that saves a checkpoint -- waits for a
    step to come. Its collectives are the only ones on their group: the order of their issue is
    the same on every rank, their timing need not be."""

    def __init__(self, lands_at: int, landing: dict[int, Tensor], exchanges: Sequence[comm.Stages] = (),
                 error: BaseException | None = None) -> None:
        self.lands_at, self.landing = lands_at, landing
        self.bytes_sent = 0
        self._error = error  # an exchange that failed at its launch raises where it is joined
        self._thread: threading.Thread | None = None
        if exchanges:
            self._thread = threading.Thread(target=self._run, args=(exchanges,), name="onebit-delayed-exchange",
                                            daemon=True)
            self._thread.start()
            _RUNNING.add(self)

    def _run(self, exchanges: Sequence[comm.Stages]) -> None:
        try:
            with comm.measure() as meter:  # this thread's own meter: the optimizer adds its bytes when it lands
                for stages in exchanges:
                    comm.run_stages(stages)
            self.bytes_sent = meter.bytes_sent
        except BaseException as exc:  # raised where it is joined, in step() or state_dict()
            self._error = exc

    def join(self) -> None:
        """Wait for the exchange to complete; raise what stopped it (a timeout: a dead peer)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            _RUNNING.discard(self)
        if self._error is not None:
            raise self._error


# The flights whose thread may still be running. A daemon thread still inside a collective when
# the interpreter finalizes is ended by pthread_exit as it takes the GIL back from C++ --
# "terminate called without an active exception", an abort -- and a run that ends between a
# launch and its landing without wait() had one there on most exits. The threads are daemons so
# that nothing waits for them unseen; instead they are completed at exit, each bounded by its
# collectives' timeout (a process group destroyed before then keeps serving the collectives
# already issued on it: the exchange still completes on every rank).
_RUNNING: weakref.WeakSet[Flight] = weakref.WeakSet()


@atexit.register
def _complete_at_exit() -> None:
    # Registered after onebit.comm's own exit handler, so it runs before it (atexit is last in,
    # first out), while the collectives' workers and the GIL still serve the threads.
    for flight in list(_RUNNING):
        try:
            flight.join()
        except Exception as exc:  # logged: what an exit handler raises is printed without its context
            _log.error("DiLoCo: the exchange in flight to step %d failed while the process exited (%s); call "
                       "opt.wait() before the end of the run to have it raise there", flight.lands_at, exc)
        else:
            _log.warning("DiLoCo: the exchange in flight to step %d was completed at exit and never landed; call "
                         "opt.wait() before the end of the run (and before destroy_process_group())", flight.lands_at)
