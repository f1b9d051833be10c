"""
The llama client: streams a chat over a Unix socket with bounded waits, liveness, a thinking
cap, a slot gate and retries; embeddable in any Twisted program.
"""
