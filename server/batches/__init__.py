"""OpenAI's Batch API: a file of requests run in the rows interactive requests leave (engine priority 1), kept in
the state store line by line so that a batch survives a restart."""
