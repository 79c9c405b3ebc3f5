"""The data port's bounds on what a client may send (router/data_connection.py enforces them)."""

from __future__ import annotations

MAX_HEADER_BYTES = 8190  # one header line, as aiohttp's parser bounds it
MAX_HEADERS_TOTAL = 64 * 1024
MAX_HEADER_COUNT = 128  # as aiohttp's server bounds it: thousands of tiny ones fit the byte bound
# A whole head (request line, fields, their framing) within the caps above is under this. The
# parser hands a header over only once its line ends, so an unfinished one is bounded as it comes.
MAX_HEAD_BYTES = MAX_HEADERS_TOTAL + 2 * MAX_HEADER_BYTES
MAX_PIPELINED = 32  # parsed requests waiting behind the one being served: then reading pauses
QUEUED_BODY_BYTES = 256 * 1024  # body a waiting request may buffer before reading pauses
# A Content-Length body with this much left once its head is parsed is read into a buffer of
# its own length, not through the parser (which would copy it once more, into its own pieces).
DIRECT_BODY_BYTES = 64 * 1024
# The server's read buffer: a whole small request, or a large one's head and its body's first
# bytes, which are copied out of it (the rest of a large body is read into its own buffer).
READ_BUFFER_BYTES = DIRECT_BODY_BYTES
MALFORMED_KINDS = {413: "request_too_large", 431: "request_too_large"}
# Headers a request may carry once (as aiohttp's parser holds them): two values are ambiguous
SINGLETONS = frozenset({"authorization", "content-length", "content-location", "content-range",
                        "content-type", "etag", "host", "max-forwards", "server",
                        "transfer-encoding", "user-agent"})


class Malformed(Exception):
    """Raised by a parser callback: the request is answered `status` and the connection closed."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
