"""The error path of a failed request: it reports every request's MPI error without blocking on the others."""

from mpi4py import MPI

from loom.comm import progress


class _Pending:
    """A request that never completes (its peer failed and will not send)."""

    def Test(self, status=None):
        return False

    def Wait(self, status=None):
        raise AssertionError("Wait on a request that may never complete: the error path would hang here")


class _Truncated:
    def Test(self, status=None):
        raise MPI.Exception(MPI.ERR_TRUNCATE)

    Wait = Test


def test_failed_group_reports_errors_without_waiting_on_the_rest():
    msg = progress._status_errors([_Pending(), _Truncated(), _Pending()])
    assert "truncat" in msg.lower() and "receive buffer smaller" in msg, msg
