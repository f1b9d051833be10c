"""
The front doors (DESIGN §3 decision 40): each wire API loopd serves, as a reader of its
requests and a writer of its answers, and the table of which path is which door.

Pure: nothing here does I/O, imports Twisted, or knows the exchange, the mesh, the upstream
call, the sessions or the leases (C{loopd/test/test_layout.py} holds the rule). A door reads a
body into the gateway's one request model (L{loopd.gateway.request.GatewayRequest}) and
writes an answer from the call's events and completion; L{loopd.gateway.exchange} does
everything between, the same for every door.

  - L{door}: what a door is (L{door.Door}, L{door.Answer}), the SSE lines every door writes,
    loopd's own events as comment lines.
  - L{table}: the path of each door, from which the site builds its routes and the HTTP
    channel its error shapes.
  - L{fields}: the one field reader the readers share, the integer rule once.
  - L{params}: the chat-completions body fields passed through, read, ignored or refused.
  - L{hosted_tools}: the tools only an API's own servers run, dropped or refused.
  - per API a reader and a writer: L{chat_read} and L{chat} (OpenAI chat completions),
    L{messages_read} and L{messages} (Anthropic Messages), L{responses_read} and
    L{responses} (OpenAI Responses), with L{responses_store} keeping finished responses for
    C{previous_response_id}.

Adding a fourth API (Ollama's C{/api/chat}) is a reader module, a writer module whose door
class has the L{door.Door} methods, and one entry in L{table.front_doors}; the exchange, the
router and the mesh need no edit (docs/doors.md; an API with the model in its path, as
Gemini's, would also need the site to route by path prefix).
"""
