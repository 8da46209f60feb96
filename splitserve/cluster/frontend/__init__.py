"""The frontend's asyncio side: admits requests, drives them through the workers over one
ZeroMQ socket, merges their outputs into one stream, recovers from failures, exports
metrics and serves operator actions."""
