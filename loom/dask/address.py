"""mpi:// addresses (``mpi://HOST/RANK/PORT``) and the window of MPI tags the backend takes."""

from __future__ import annotations

__all__ = ["SCHEME", "parse_mpi_address", "tag_window"]

SCHEME = "mpi"


def parse_mpi_address(loc: str) -> tuple[str | None, int | None, int | None]:
    """``"HOST/RANK/PORT"`` -> ``(host, rank, port)``; missing parts are ``None``.

    Accepted: ``""``, ``"HOST"``, ``"RANK"``, ``"HOST/RANK"``, ``"RANK/PORT"``, ``"HOST/RANK/PORT"``.
    """
    if not isinstance(loc, str):
        raise TypeError(f"mpi address location must be a str, got {type(loc).__name__}")
    loc = loc.strip()
    if loc.startswith(f"{SCHEME}://"):
        loc = loc[len(SCHEME) + 3:]
    if not loc:
        return None, None, None
    parts = loc.split("/")

    def num(text: str, what: str) -> int:
        if not text.isdigit():
            raise ValueError(
                f"mpi address {loc!r}: {what} {text!r} is not a non-negative integer; "
                f"write mpi://HOST/RANK/PORT (e.g. mpi://node1/2/7) or mpi:// to listen on this rank"
            )
        return int(text)

    if len(parts) == 3:
        return parts[0] or None, num(parts[1], "rank"), num(parts[2], "port")
    if len(parts) == 2:
        if parts[0].isdigit() and parts[1].isdigit():
            return None, int(parts[0]), int(parts[1])
        return parts[0] or None, num(parts[1], "rank"), None
    if len(parts) == 1:
        return (None, int(parts[0]), None) if parts[0].isdigit() else (parts[0], None, None)
    raise ValueError(f"mpi address {loc!r} has {len(parts)} '/'-separated parts; write mpi://HOST/RANK/PORT")


def _unparse(host: str | None, rank: int, port: int | None) -> str:
    loc = f"{rank}" if host is None else f"{host}/{rank}"
    return f"{SCHEME}://{loc}" if port is None else f"{SCHEME}://{loc}/{port}"


def tag_window(tag_ub: int) -> tuple[int, int]:
    """``(control tag, last tag)`` of the mpi:// backend under an MPI whose largest tag is ``tag_ub``.

    The backend takes the upper half of the tag space, at most ``[2**24, 2**28)`` (loom's own point-to-point
    tags are small): with MPICH's ``2**29 - 1`` that is ``[2**24, 2**28)``, under Open MPI over UCX
    (``2**23 - 1``) ``[2**22, 2**23)``, under the standard's minimum 32767 ``[16384, 32767]``, i.e. 8191
    connections open at once per rank (tags of closed connections are reused).
    """
    last = min(int(tag_ub), (1 << 28) - 1)
    ctrl = min(1 << 24, (last + 1) // 2)
    if last - ctrl < 64:
        raise ValueError(f"MPI_TAG_UB={tag_ub} leaves the mpi:// backend {max(last - ctrl, 0)} tags (it needs 64); "
                         f"the MPI standard guarantees 32767, so this MPI (or LOOM_TAG_UB) is misconfigured")
    return ctrl, last
