"""The router: pure placement logic (no sockets, threads or I/O). Given a request's block
hashes and every worker's load, it picks a decode worker and, when disaggregation pays, a
prefill worker (DESIGN 5). The frontend calls it from its event loop only."""
