"""
The llama client: streams a chat over a Unix socket with bounded waits, liveness, a thinking
cap through the server's reasoning-end control, a slot gate and retries; embeddable in any
Twisted program.

    client = Client(reactor, config, config.endpoints[0])
    d = client.chat_with_retry(ChatRequest(slot=0, messages=(User("Hi"),)), print)

A consumer that streams the answer on registers a L{Flow} as its producer and passes it as
C{flow=}, so that a reader who falls behind pauses the read from the server.

Everything public lives in the private-purpose modules beside this one and is re-exported
here; import from C{loopd.llama}.
"""

from loopd.errors import (
    Busy,
    Connect,
    Http,
    InferError,
    LoadTimeout,
    Protocol,
    Stalled,
    StreamClosedEarly,
    ThinkingOverrun,
    WaitTimeout,
)
from loopd.llama.client import Client
from loopd.llama.flow import Flow
from loopd.llama.gate import ISlotGate, NoGate, SlotGate
from loopd.llama.info import CacheOutcome, Health, SlotState, cache_outcome
from loopd.llama.types import (
    Assistant,
    ChatEvent,
    ChatMessage,
    ChatRequest,
    Completion,
    Content,
    FinishReason,
    Progress,
    Queued,
    Reasoning,
    Retrying,
    System,
    ThinkingCapped,
    Timings,
    Tool,
    ToolCall,
    ToolCallDelta,
    ToolSchema,
    User,
    Waiting,
)

__all__ = [
    "Assistant",
    "Busy",
    "CacheOutcome",
    "ChatEvent",
    "ChatMessage",
    "ChatRequest",
    "Client",
    "Completion",
    "Connect",
    "Content",
    "FinishReason",
    "Flow",
    "Health",
    "Http",
    "ISlotGate",
    "InferError",
    "LoadTimeout",
    "NoGate",
    "Progress",
    "Protocol",
    "Queued",
    "Reasoning",
    "Retrying",
    "SlotGate",
    "SlotState",
    "Stalled",
    "StreamClosedEarly",
    "System",
    "ThinkingCapped",
    "ThinkingOverrun",
    "Timings",
    "Tool",
    "ToolCall",
    "ToolCallDelta",
    "ToolSchema",
    "User",
    "WaitTimeout",
    "Waiting",
    "cache_outcome",
]
