"""
Transitional alias: the in-memory Unix network moved to L{loopd.testing.memory_net}, loopd's
public test kit. Import it from there; this module re-exports it only while test modules on
branches made before the move still import it from here, and goes once none does.
"""

from loopd.testing.memory_net import (
    MAX_PUMP_ROUNDS,
    MemoryConnection,
    MemoryNet,
    connect_pending,
)

__all__ = [
    "MAX_PUMP_ROUNDS",
    "MemoryConnection",
    "MemoryNet",
    "connect_pending",
]
