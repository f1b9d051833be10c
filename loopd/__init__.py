"""
loopd: bounded, cache-friendly access to local LLM servers for coding-agent sessions.

The package is a set of small Twisted modules; README.md and the manual in docs/ say what
each command does.
Only L{loopd.inferproxy} speaks TCP: everything else reaches a model through a Unix socket.
"""

__version__ = "0.1.0.dev0"
