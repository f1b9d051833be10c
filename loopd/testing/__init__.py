"""
loopd's public test kit: the doubles loopd's own tests run on, for programs that embed loopd
to test themselves against, in memory, on one C{MemoryReactorClock}, with nothing sleeping.

As C{treq.testing} is the test double of treq's HTTP stack and C{twisted.internet.testing}
Twisted's, these are loopd's. They depend on Twisted, treq, prometheus_client and loopd only.

 - L{loopd.testing.reactor}: the C{MemoryReactorClock} that provides loopd's reactor
   interfaces (L{MemoryLoopdReactor <loopd.testing.reactor.MemoryLoopdReactor>}), for the
   parts that take an L{IUnixReactor <loopd.reactor.IUnixReactor>} or an
   L{IServiceReactor <loopd.reactor.IServiceReactor>}.
 - L{loopd.testing.fake_llama}: a scripted llama-server speaking raw HTTP/1.1
   (L{FakeLlama <loopd.testing.fake_llama.FakeLlama>}): every reply byte and its timing
   scripted per route (L{Reply <loopd.testing.fake_llama.Reply>}, C{sse_reply},
   C{json_reply}, C{error_reply}), every request and connection recorded. It runs on a real
   Unix socket as well as in memory.
 - L{loopd.testing.llama_replies}: what llama-server answers, ready to script: a chat
   stream's C{chunk}s and a whole C{answer}, C{/slots}, C{/props}, the reasoning-end control.
 - L{loopd.testing.memory_net}: Unix-socket connections in memory
   (L{MemoryNet <loopd.testing.memory_net.MemoryNet>}): a client's C{connectUNIX} on the
   memory reactor reaches the factory listening at its path; C{advance} moves the clock from
   one scheduled call to the next, pumping the bytes after each.
 - L{loopd.testing.lease_daemon}: the lease daemon without a process
   (L{FakeLeaseDaemon <loopd.testing.lease_daemon.FakeLeaseDaemon>}), the real scheduler and
   wire layer on the memory network, for programs that embed
   L{loopd.queue.client.LeaseClient}; it records what clients send, and can stop, die and
   start again.
 - L{loopd.testing.gateway}: the whole gateway (C{twist loopd}'s HTTP front) in memory
   (L{GatewayHarness <loopd.testing.gateway.GatewayHarness>}) over one fake llama-server per
   endpoint: raw HTTP requests in, parsed responses out, leases optional.
 - L{loopd.testing.mesh}: that gateway over several workers for C{model: "mesh"} scenarios
   (L{MeshHarness <loopd.testing.mesh.MeshHarness>}), and the replies a worker gives.

Each name is imported from its module: this package re-exports nothing, so that importing
the fake server does not import the gateway. A program that takes a lease and then asks a
model (C{ask(client, leases, text)}), tested against both fakes::

    reactor = MemoryLoopdReactor()
    net = MemoryNet(reactor)
    llama = FakeLlama(reactor)
    net.listen(PATH, llama)
    llama.script("POST", CHAT, answer({"content": "Hello"}))
    daemon = FakeLeaseDaemon(net)
    config = make_config()
    client = Client(reactor, config, config.endpoints[0])
    d = ask(client, LeaseClient(reactor, daemon.path), "Hi")
    net.advance(1)
    self.assertEqual(self.successResultOf(d), "Hello")
    self.assertEqual([m["op"] for m in daemon.ops()], ["acquire", "release"])

(C{PATH} and C{make_config} are L{loopd.testing.gateway}'s: a config whose endpoint
C{tiny} is at C{PATH}, every limit between 50 and 200 ms.)
"""
