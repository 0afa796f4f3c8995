"""llama.cpp's /tokenize and /detokenize: wire models and route."""
