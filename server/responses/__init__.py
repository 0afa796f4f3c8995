"""OpenAI's Responses API: wire models, stored responses, route and event generator."""
