"""OpenAI's Files API: uploads kept in the state store (batch input, and the batches' output and error files)."""
