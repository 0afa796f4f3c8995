"""OpenAI's Embeddings API (and llama.cpp's forms): wire models and route."""
