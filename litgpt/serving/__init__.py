"""`litgpt serve`: an OpenAI-compatible HTTP server (`server`) over a continuous-batching decoder (`engine`)."""
