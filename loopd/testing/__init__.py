"""
loopd's public test kit: the doubles loopd's own tests run on, for programs that embed loopd
to test themselves against, in memory, on one C{MemoryReactorClock}, with nothing sleeping.
They depend on Twisted, treq, prometheus_client and loopd only.

 - L{loopd.testing.fake_llama}: a scripted llama-server speaking raw HTTP/1.1, every reply
   byte and its timing scripted per route, every request recorded.
 - L{loopd.testing.memory_net}: Unix-socket connections in memory on a C{MemoryReactorClock}.
"""
