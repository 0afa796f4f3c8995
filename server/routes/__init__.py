"""HTTP routes: thin handlers that validate, tokenize in a thread, and hand off to server.http.streaming."""
