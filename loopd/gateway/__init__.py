"""
The OpenAI-compatible session gateway: the HTTP front that agent sessions talk to over
C{loopd.sock}, translating OpenAI chat requests into llama client requests and back.
"""
