"""
loopd's C{twist} commands. Each entry names a module whose C{Options} and C{makeService} are
imported only when the command runs, so C{twist --help} stays cheap.
"""

from twisted.application.service import ServiceMaker

inferproxy = ServiceMaker(
    "loopd inferproxy",
    "loopd.tap.inferproxy",
    "Forward a Unix socket to a TCP server with hard limits.",
    "inferproxy",
)

loopd = ServiceMaker(
    "loopd",
    "loopd.tap.loopd",
    "The OpenAI-compatible session gateway in front of local model servers.",
    "loopd",
)

llmqueue = ServiceMaker(
    "loopd llmqueue",
    "loopd.tap.llmqueue",
    "The LLM lease queue daemon: fair turns on shared model endpoints.",
    "llmqueue",
)
