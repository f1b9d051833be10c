"""
The requests real coding agents sent, kept as fixtures (issue 24): C{fixtures/agents/*.json}.

Each fixture file is what one agent (one of its APIs) sent over two turns with its default
tools and prompts, captured by a logging reverse proxy in front of a real llama-server (so
every request is one the server took), reduced to its shape: the method, the path, the
headers that name a session and the body with every long string replaced by a marker of its
length (C{"<text: 17423 chars>"}). The shape is what the front doors judge (fields, roles,
block, item and tool types, schemas); the agents' own prompt texts stay out of the
repository.

Run C{python -m loopd.test.support.agent_captures AGENT CAPTURE_DIR OUT.json} to make one
from a capture directory, whose C{NNN.json} files each hold one request as the proxy wrote
it: C{{"method", "path", "headers": [[name, value], ...], "json": body}}.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import loopd

__all__ = ["FIXTURES", "SESSION_HEADERS", "load", "main", "skeleton"]

FIXTURES = Path(loopd.__file__).parent.parent / "fixtures" / "agents"
"""Where the fixture files are."""
SESSION_HEADERS = frozenset(
    {
        "x-session-id",
        "x-claude-code-session-id",
        "session-id",
        "session_id",
        "x-session-affinity",
        "agent-session-id",
        "anthropic-beta",
        "anthropic-version",
    }
)
"""The headers a fixture keeps (lower-case): the session ids and Anthropic's version headers."""
#: Strings up to this long are kept as they are (names, enums, ids, short values).
_KEEP = 64


def skeleton(value: Any) -> Any:
    """C{value} with every string longer than 64 characters replaced by its length's marker."""
    if isinstance(value, str):
        return value if len(value) <= _KEEP else f"<text: {len(value)} chars>"
    if isinstance(value, list):
        return [skeleton(item) for item in value]
    if isinstance(value, dict):
        return {key: skeleton(item) for key, item in value.items()}
    return value


def _request(capture: dict[str, Any]) -> dict[str, Any]:
    """One captured request, reduced."""
    headers = {
        name.lower(): value for name, value in capture["headers"] if name.lower() in SESSION_HEADERS
    }
    return {
        "method": capture["method"],
        "path": capture["path"],
        "headers": headers,
        "body": skeleton(capture.get("json")),
    }


def load(name: str) -> list[dict[str, Any]]:
    """The requests of fixture C{name} (C{claude-code}, C{codex} ...), in order."""
    requests: list[dict[str, Any]] = json.loads((FIXTURES / f"{name}.json").read_text())
    return requests


def main(argv: Sequence[str] | None = None) -> int:
    """Write one fixture file from a capture directory (the module docstring says how)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    agent, directory, out = args
    captures = sorted(Path(directory).glob("[0-9][0-9][0-9].json"))
    requests = [_request(json.loads(path.read_text())) for path in captures]
    Path(out).write_text(json.dumps(requests, indent=1, ensure_ascii=False) + "\n")
    print(f"{agent}: {len(requests)} requests -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
