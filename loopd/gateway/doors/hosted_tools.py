# -*- test-case-name: loopd.test.test_doors_hosted_tools -*-
"""
Hosted tools (DESIGN §3 decision 43): the tools that an API's own servers run, which no local
model can: OpenAI's C{web_search}, C{file_search}, C{code_interpreter}, C{computer_use},
C{image_generation} and C{mcp} (and their dated and preview names); Anthropic's server tools,
C{web_search_*}, C{web_fetch_*}, C{code_execution_*}, C{tool_search_tool_*} and
C{mcp_toolset}. Coding agents offer them by default (Codex CLI offers C{web_search} on every
request and has no switch for it), so refusing them would refuse the agent.

A front door that meets one removes it from what the model sees and names it in the
request's C{dropped}; the route then names every dropped tool in the answer's
C{X-Loopd-Dropped} header, logs it and counts it (C{loopd_dropped_tools_total}).
C{[doors] hosted_tools = "refuse"} makes such a tool a 400 C{hosted_tool} naming it instead,
for a user who would rather know than have the model answer without it.

The tools a client runs itself but whose schema is the API's own (Anthropic's C{bash_*},
C{text_editor_*}, C{computer_*}, C{memory_*}) are not hosted: the client would run them, but
a local model does not know their schema, so the doors still refuse them, saying so.

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final, Literal

from loopd.gateway.doors.fields import fail

__all__ = [
    "DROPPED_HEADER",
    "HostedTools",
    "dropped_hosted",
    "hosted_messages_tool",
    "hosted_responses_tool",
    "refuse_hosted",
]

HostedTools = Literal["drop", "refuse"]
"""What the doors do with a hosted tool: leave it out (and say so), or refuse the request."""

DROPPED_HEADER: Final = b"x-loopd-dropped"
"""The answer's header that names the hosted tools left out of its request, comma-separated."""

#: OpenAI's hosted tool types (Responses API), as a request names them.
_RESPONSES_HOSTED: Final = frozenset(
    {
        "web_search",
        "web_search_preview",
        "web_search_preview_2025_03_11",
        "web_search_2025_08_26",
        "file_search",
        "code_interpreter",
        "computer_use",
        "computer_use_preview",
        "image_generation",
        "mcp",
    }
)
#: How Anthropic's server tool types start (each kind has dated versions).
_MESSAGES_HOSTED_PREFIXES: Final = (
    "web_search_",
    "web_fetch_",
    "code_execution_",
    "tool_search_tool_",
)


def hosted_responses_tool(kind: str) -> bool:
    """Whether a Responses tool of type C{kind} is one that OpenAI's servers run."""
    return kind in _RESPONSES_HOSTED


def hosted_messages_tool(kind: str) -> bool:
    """Whether a Messages tool of type C{kind} is one of Anthropic's server tools."""
    return kind == "mcp_toolset" or kind.startswith(_MESSAGES_HOSTED_PREFIXES)


def refuse_hosted(path: str, kind: str) -> None:
    """
    Refuse the hosted tool at C{path} (C{[doors] hosted_tools = "refuse"}).

    @raise GatewayError: 400 C{hosted_tool} naming the tool and what to do.
    """
    fail(
        "hosted_tool",
        path,
        f"{kind} is run by the API's own servers, which a local model cannot do; loopd is "
        'set to refuse such tools ([doors] hosted_tools = "refuse"; "drop" leaves them out '
        "and names them in X-Loopd-Dropped)",
    )


def dropped_hosted(
    kind: object,
    path: str,
    policy: HostedTools,
    dropped: list[str],
    hosted: Callable[[str], bool],
) -> bool:
    """
    Whether the tool whose type is C{kind} (at C{path}) is a hosted tool, as the door's
    C{hosted} says (L{hosted_responses_tool}, L{hosted_messages_tool}): left out and named
    once in C{dropped}, or under C{policy} C{refuse} refused (L{refuse_hosted}).
    """
    if not isinstance(kind, str) or not hosted(kind):
        return False
    if policy == "refuse":
        refuse_hosted(path, kind)
    if kind not in dropped:
        dropped.append(kind)
    return True
