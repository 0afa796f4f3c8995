"""OpenAI's Conversations API: conversations and their items, kept in the state store."""
