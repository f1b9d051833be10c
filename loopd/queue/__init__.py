"""
The lease queue: the seed's C{llm-queue} scheduler, its policy, socket protocol, daemon and
client. C{scheduler} is the pure core the others drive.
"""
