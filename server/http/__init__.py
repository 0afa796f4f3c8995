"""A request's HTTP life, shared by every protocol: prompt preparation, the engine run and SSE framing, body
limits, timeouts, security and memory guards."""
