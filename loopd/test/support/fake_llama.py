"""
Transitional alias: the scripted fake llama-server moved to L{loopd.testing.fake_llama} and
L{loopd.testing.llama_replies}, loopd's public test kit. Import it from there; this module
re-exports it only while test modules on branches made before the move still import it from
here, and goes once none does.
"""

from loopd.testing.fake_llama import (
    CHAT,
    CONTROL,
    JSON_HEADERS,
    LOADING,
    NOT_FOUND,
    PROPS,
    SLOTS,
    SSE_HEADERS,
    TOKENIZE,
    ConnectionRecord,
    End,
    FakeLlama,
    FakeLlamaProtocol,
    Framing,
    Piece,
    RecordedRequest,
    Reply,
    ReplySource,
    RequestParser,
    error_reply,
    event_bytes,
    json_reply,
    sse_reply,
)
from loopd.testing.llama_replies import (
    TIMINGS,
    answer,
    chunk,
    control_reply,
    props_reply,
    slots_reply,
)

__all__ = [
    "CHAT",
    "CONTROL",
    "JSON_HEADERS",
    "LOADING",
    "NOT_FOUND",
    "PROPS",
    "SLOTS",
    "SSE_HEADERS",
    "TIMINGS",
    "TOKENIZE",
    "ConnectionRecord",
    "End",
    "FakeLlama",
    "FakeLlamaProtocol",
    "Framing",
    "Piece",
    "RecordedRequest",
    "Reply",
    "ReplySource",
    "RequestParser",
    "answer",
    "chunk",
    "control_reply",
    "error_reply",
    "event_bytes",
    "json_reply",
    "props_reply",
    "slots_reply",
    "sse_reply",
]
